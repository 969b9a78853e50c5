// Decoder kernels for the CUDA backend, compiled by NVRTC at run time.
//
// Activations, weights and the KV cache are 16-bit (bf16, or fp16 when the
// module is compiled with NI_F16=1), stored as raw `unsigned short` so the
// source needs no CUDA headers; all arithmetic is in f32. Where transformers
// rounds an intermediate to the activation dtype (RMSNorm before the weight
// multiply, RoPE products, SiLU before the up multiply, residual adds) these
// kernels round at the same place, so greedy tokens track the reference.
//
// Layout: row-major `[rows, width]`; the fused QKV buffer holds q | k | v per
// row. The KV cache of one layer is `[slots, kv_heads * head_dim]`.

#include "common.cuh"

// out[r] = table[tokens[r]]; grid = rows. A token outside the table reads
// row 0: a chained step's row whose previous id was the non-finite marker
// (0xffffffff, see argmax_merge) is a placeholder its request never sees.
extern "C" __global__ void embed(const raw16* table, const unsigned* tokens, raw16* out, int d,
                                 int vocab) {
    GRID_DEP_ENTER();
    const unsigned token = tokens[blockIdx.x];
    const raw16* src = table + (size_t)(token < (unsigned)vocab ? token : 0u) * d;
    raw16* dst = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}

// Output row j reads input row r = rows ? rows[j] : j. With `delta`, the
// residual row becomes residual + delta (written back when `rows` is null).
// out[j] = rmsnorm(residual[r]) * w. One pass: each thread keeps its
// elements in registers between the sum of squares and the output, in runs
// of eight consecutive values (16-byte loads and stores; d is a multiple of
// 8). (A thread's elements a block's width apart, in 2-byte accesses, made
// an 8192-row prefill norm stream at ~1.1 TB/s.) The sum of squares keeps
// that older order all the same, thread t adding elements t, t + B, ...
// (B = blockDim.x) through shared memory, so rstd, and every output, is
// bit for bit what it was: the fused norms of the GEMVs and int4 kernels
// are checked against it. grid = output rows.
extern "C" __global__ void add_rms_norm(raw16* residual, const raw16* delta, const unsigned* rows,
                                        const raw16* w, raw16* out, int d, float eps) {
    __shared__ __align__(16) raw16 values[NORM_MAX_D];  // the row, as rounded to the activation dtype
    GRID_DEP_ENTER();
    const size_t r = rows ? rows[blockIdx.x] : blockIdx.x;
    float v[NORM_VECS][8];
    const float rstd = add_rms_norm_row(residual, delta, r, delta && !rows, d, eps, values, v);
    uint4* y = (uint4*)(out + (size_t)blockIdx.x * d);
#pragma unroll
    for (int j = 0; j < NORM_VECS; j++) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < d / 8) {
            float g[8];
            unpack8(((const uint4*)w)[i], g);
            unsigned o[4];
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[e] = pack2(rms_normed(g[2 * e], v[j][2 * e], rstd), rms_normed(g[2 * e + 1], v[j][2 * e + 1], rstd));
            y[i] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}

// Per-head RMSNorm (Qwen3 q_norm / k_norm) in place on heads starting at
// column `offset` of rows of stride `stride`. grid = (rows, heads), block = 32.
extern "C" __global__ void head_rms_norm(raw16* x, const raw16* w, int stride, int offset, int hd,
                                         float eps) {
    GRID_DEP_ENTER();
    raw16* h = x + (size_t)blockIdx.x * stride + offset + (size_t)blockIdx.y * hd;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hd; i += 32) {
        const float v = to_f(h[i]);
        ss += v * v;
    }
    const float rstd = rsqrtf(warp_sum(ss) / hd + eps);
    for (int i = threadIdx.x; i < hd; i += 32) h[i] = from_f(to_f(w[i]) * rnd(to_f(h[i]) * rstd));
}

// x[r, i] += b[i]; grid = rows.
extern "C" __global__ void add_bias(raw16* x, const raw16* b, int width) {
    GRID_DEP_ENTER();
    raw16* row = x + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = from_f(to_f(row[i]) + to_f(b[i]));
}

// cs[r][i] = (cos, sin) of positions[r] * inv_freq[i], rounded to the
// activation dtype as transformers does: computed once per step for every
// layer's RoPE. grid = rows.
extern "C" __global__ void rope_table(const int* positions, const float* inv_freq, int half,
                                      float2* cs) {
    GRID_DEP_ENTER();
    const float pos = (float)positions[blockIdx.x];
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        cs[(size_t)blockIdx.x * half + i] = make_float2(rnd(c), rnd(s));
    }
}

// Rotary embedding (rotate-half form) in place on the q and k heads of the
// fused QKV rows, angles from rope_table. A thread takes a run of eight
// pairs (16-byte accesses) when half a head is a multiple of 8, else one
// pair; the arithmetic per pair is the same. grid = rows.
extern "C" __global__ void rope(raw16* qkv, const float2* cs, int stride, int heads, int hd) {
    GRID_DEP_ENTER();
    const int half = hd / 2;
    const float2* row_cs = cs + (size_t)blockIdx.x * half;
    raw16* row = qkv + (size_t)blockIdx.x * stride;
    const int run = half % 8 == 0 ? 8 : 1, runs = half / run;
    for (int t = threadIdx.x; t < heads * runs; t += blockDim.x) {
        const int i = (t % runs) * run;
        raw16* p = row + (t / runs) * hd + i;
        if (run == 1) {
            float x1 = to_f(p[0]), x2 = to_f(p[half]);
            rope_rotate(x1, x2, row_cs[i].x, row_cs[i].y);
            p[0] = from_f(x1);
            p[half] = from_f(x2);
            continue;
        }
        float x1[8], x2[8];
        unpack8(*(const uint4*)p, x1);
        unpack8(*(const uint4*)(p + half), x2);
#pragma unroll
        for (int e = 0; e < 8; e++) rope_rotate(x1[e], x2[e], row_cs[i + e].x, row_cs[i + e].y);
        *(uint4*)p = make_uint4(pack2(x1[0], x1[1]), pack2(x1[2], x1[3]), pack2(x1[4], x1[5]),
                                pack2(x1[6], x1[7]));
        *(uint4*)(p + half) = make_uint4(pack2(x2[0], x2[1]), pack2(x2[2], x2[3]),
                                         pack2(x2[4], x2[5]), pack2(x2[6], x2[7]));
    }
}

// out[r, i] = silu(gate[r, i]) * up[r, i] over rows of [gate | up], eight
// columns per thread (16-byte loads when inter is a multiple of 8).
// grid = (ceil(inter / (8 * blockDim.x)), rows).
extern "C" __global__ void silu_mul(const raw16* gate_up, raw16* out, int inter) {
    GRID_DEP_ENTER();
    const raw16* g = gate_up + (size_t)blockIdx.y * 2 * inter;
    raw16* y = out + (size_t)blockIdx.y * inter;
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= inter) return;
    if ((inter & 7) == 0) {
        float a[8], b[8];
        unpack8(*(const uint4*)(g + i), a);
        unpack8(*(const uint4*)(g + inter + i), b);
        unsigned o[4];
#pragma unroll
        for (int k = 0; k < 4; k++)
            o[k] = pack2(silu_mul_f(a[2 * k], b[2 * k]), silu_mul_f(a[2 * k + 1], b[2 * k + 1]));
        *(uint4*)(y + i) = make_uint4(o[0], o[1], o[2], o[3]);
    } else {
        for (int e = i; e < min(inter, i + 8); e++)
            y[e] = from_f(silu_mul_f(to_f(g[e]), to_f(g[inter + e])));
    }
}

// Copies each row's k and v (columns k_off.. and v_off.. of the QKV row) to
// its slot of the layer's cache (kv_write_fp8: an FP8 cache). grid = rows.
template <typename KV>
__device__ void kv_write_row(const raw16* qkv, int stride, int k_off, int v_off,
                             const unsigned* slots, KV* k_cache, KV* v_cache, int kv_width) {
    GRID_DEP_ENTER();
    const raw16* row = qkv + (size_t)blockIdx.x * stride;
    const size_t dst = (size_t)slots[blockIdx.x] * kv_width;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        kv_store(k_cache + dst + i, to_f(row[k_off + i]));
        kv_store(v_cache + dst + i, to_f(row[v_off + i]));
    }
}
#define KV_WRITE_KERNEL(NAME, KV)                                                                   \
    extern "C" __global__ void NAME(const raw16* qkv, int stride, int k_off, int v_off,             \
                                    const unsigned* slots, KV* k_cache, KV* v_cache, int kv_width) { \
        kv_write_row(qkv, stride, k_off, v_off, slots, k_cache, v_cache, kv_width);                 \
    }
KV_WRITE_KERNEL(kv_write, raw16)
KV_WRITE_KERNEL(kv_write_fp8, fp8)
#undef KV_WRITE_KERNEL

#define ATTN_WARPS 8
#define ATTN_STEPS 2  // position groups each warp loads per iteration (loads in flight)
#define ATTN_GROUP 4  // query heads per block; they share one kv head (GQA)
#define ATTN_HD_MAX 256

// The end of a decode attention block for one query head: merges the
// softmax states of its warps (warp w: max m[w * ml_step], sum
// l[w * ml_step], unnormalized sums o[w * o_stride + i]), where
// weight(max - best) rescales a warp's sums, and stores the head: normalized
// to out[rh] with one split, else the sums to part_o and (max in natural-log
// units: best * nat_scale, sum) to part_ml at partial ph, for attn_merge.
template <int WARPS, typename Weight>
__device__ void store_merged_head(const float* m, const float* l, int ml_step, const float* o,
                                  int o_stride, Weight weight, float nat_scale, int hd,
                                  size_t rh, size_t ph, int split, int splits, raw16* out,
                                  float* part_o, float* part_ml) {
    float big = -NI_INF;
    for (int w = 0; w < WARPS; w++) big = fmaxf(big, m[w * ml_step]);
    float total = 0.f, f[WARPS];
    for (int w = 0; w < WARPS; w++) {
        f[w] = l[w * ml_step] > 0.f ? weight(m[w * ml_step] - big) : 0.f;
        total += l[w * ml_step] * f[w];
    }
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < WARPS; w++) acc += o[w * o_stride + i] * f[w];
        if (splits == 1)
            out[rh * hd + i] = from_f(total > 0.f ? acc / total : 0.f);
        else
            part_o[(ph * splits + split) * hd + i] = acc;
    }
    if (splits > 1 && threadIdx.x == 0) {
        part_ml[(ph * splits + split) * 2] = total > 0.f ? big * nat_scale : -NI_INF;
        part_ml[(ph * splits + split) * 2 + 1] = total;
    }
}

struct AttnShared {
    float m[ATTN_GROUP][ATTN_WARPS], l[ATTN_GROUP][ATTN_WARPS];
    float acc[ATTN_WARPS][ATTN_HD_MAX];
};

// Decode attention. One block serves up to ATTN_GROUP query heads of one kv
// head (GQA: each key and value is loaded once for all of them) for one row
// and one split of its context: positions [split * chunk, min((split + 1) *
// chunk, pos + 1)) of the row's sequence, whose slots are
// slot_list[table_off[row] + p]. LPP = hd / 8 lanes share a position, each
// holding 8 of its dims (one 16-byte load), so a warp covers 32 / LPP
// positions per step and ATTN_STEPS steps per iteration; each lane group keeps
// its own online softmax (no shared-memory bound on the context length),
// merged across the warp and then across warps at the end. The next
// iteration's slots are loaded while this one computes. With one split the
// result goes to `out` ([rows, heads * hd]); otherwise the unnormalized
// partial sum and its (max, sum) go to part_o / part_ml for attn_merge. Block
// row y serves batch row row_list[y] (every row when row_list is null).
// grid = (kv_heads * ceil(group / ATTN_GROUP), rows, splits), block = 32 * ATTN_WARPS.
template <int LPP, typename KV>
__device__ void attention_group(const raw16* qkv, int stride, const KV* k_cache,
                                const KV* v_cache, const unsigned* slot_list,
                                const unsigned* table_off, const int* positions, int heads,
                                int kv_heads, float scale, raw16* out, float* part_o,
                                float* part_ml, const unsigned* row_list, AttnShared& sm) {
    const int hd = 8 * LPP, pps = 32 / LPP;
    const int group = heads / kv_heads;
    const int subs = (group + ATTN_GROUP - 1) / ATTN_GROUP;
    const int kv_head = blockIdx.x / subs;
    const int h0 = kv_head * group + (blockIdx.x % subs) * ATTN_GROUP;
    const int g_n = min(ATTN_GROUP, kv_head * group + group - h0);
    // Partials are indexed by the block row, outputs by the batch row.
    const int prow = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int row = row_list ? row_list[prow] : prow;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int sub_pos = lane / LPP, d0 = (lane % LPP) * 8;
    const int kv_width = kv_heads * hd;
    const int n = positions[row] + 1;
    const int chunk = (n + splits - 1) / splits;
    const int begin = split * chunk;
    const int end = min(n, begin + chunk);
    const unsigned* slots = slot_list + table_off[row];
    const size_t head_off = (size_t)kv_head * hd + d0;

    float q[ATTN_GROUP][8], acc[ATTN_GROUP][8], m[ATTN_GROUP], l[ATTN_GROUP];
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; g++) {
        if (g < g_n) unpack8(*(const uint4*)(qkv + (size_t)row * stride + (h0 + g) * hd + d0), q[g]);
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[g][e] = g < g_n ? q[g][e] * scale : 0.f;
            acc[g][e] = 0.f;
        }
        m[g] = -NI_INF;
        l[g] = 0.f;
    }
    const int per_iter = ATTN_STEPS * pps, stride_p = ATTN_WARPS * per_iter;
    int p0 = begin + warp * per_iter;
    unsigned sl[ATTN_STEPS];
#pragma unroll
    for (int s = 0; s < ATTN_STEPS; s++) {
        const int p = p0 + s * pps + sub_pos;
        sl[s] = p < end ? slots[p] : 0u;
    }
    for (; p0 < end; p0 += stride_p) {
        typedef typename KvRun<KV>::type Run;
        Run kr[ATTN_STEPS], vr[ATTN_STEPS];
#pragma unroll
        for (int s = 0; s < ATTN_STEPS; s++) {
            const size_t base = (size_t)sl[s] * kv_width + head_off;
            kr[s] = *(const Run*)(k_cache + base);
            vr[s] = *(const Run*)(v_cache + base);
        }
        // The next iteration's slots, in flight while this one computes.
#pragma unroll
        for (int s = 0; s < ATTN_STEPS; s++) {
            const int p = p0 + stride_p + s * pps + sub_pos;
            sl[s] = p < end ? slots[p] : 0u;
        }
        bool ok[ATTN_STEPS];
#pragma unroll
        for (int s = 0; s < ATTN_STEPS; s++) ok[s] = p0 + s * pps + sub_pos < end;
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; g++) {
            if (g >= g_n) break;
            float sc[ATTN_STEPS], best = m[g];
#pragma unroll
            for (int s = 0; s < ATTN_STEPS; s++) {
                float kf[8], dot = 0.f;
                kv_unpack8(kr[s], kf);  // again per head: registers are the tighter budget
#pragma unroll
                for (int e = 0; e < 8; e++) dot += q[g][e] * kf[e];
#pragma unroll
                for (int o = LPP / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                sc[s] = ok[s] ? dot : -NI_INF;
                best = fmaxf(best, sc[s]);
            }
            if (best == -NI_INF) continue;  // nothing of this lane group's yet
            const float corr = __expf(m[g] - best);
            float w[ATTN_STEPS], wsum = 0.f;
#pragma unroll
            for (int s = 0; s < ATTN_STEPS; s++) {
                w[s] = ok[s] ? __expf(sc[s] - best) : 0.f;
                wsum += w[s];
            }
            l[g] = l[g] * corr + wsum;
#pragma unroll
            for (int e = 0; e < 8; e++) acc[g][e] *= corr;
            m[g] = best;
#pragma unroll
            for (int s = 0; s < ATTN_STEPS; s++) {
                float vf[8];
                kv_unpack8(vr[s], vf);
#pragma unroll
                for (int e = 0; e < 8; e++) acc[g][e] += w[s] * vf[e];
            }
        }
    }
    // Merge the lane groups of the warp (lanes d0-aligned across groups).
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; g++) {
#pragma unroll
        for (int o = LPP; o < 32; o <<= 1) {
            const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float big = fmaxf(m[g], m_o);
            const float f = l[g] > 0.f ? __expf(m[g] - big) : 0.f;
            const float f_o = l_o > 0.f ? __expf(m_o - big) : 0.f;
#pragma unroll
            for (int e = 0; e < 8; e++)
                acc[g][e] = acc[g][e] * f + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * f_o;
            l[g] = l[g] * f + l_o * f_o;
            m[g] = big;
        }
    }

    // Merge the warps, one head at a time through shared memory.
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < ATTN_GROUP; g++) {
            sm.m[g][warp] = m[g];
            sm.l[g][warp] = l[g];
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_GROUP; g++) {
        if (g >= g_n) break;
        __syncthreads();  // the previous head's partial sums are consumed
        if (lane < LPP)
#pragma unroll
            for (int e = 0; e < 8; e++) sm.acc[warp][d0 + e] = acc[g][e];
        __syncthreads();
        store_merged_head<ATTN_WARPS>(
            sm.m[g], sm.l[g], 1, sm.acc[0], ATTN_HD_MAX, [](float d) { return __expf(d); }, 1.f, hd,
            (size_t)row * heads + h0 + g, (size_t)prow * heads + h0 + g, split, splits, out, part_o,
            part_ml);
    }
}

// head_dim 32, 64, 128 or 256 (the host checks); attention_fp8 reads an FP8 cache.
template <typename KV>
__device__ void attention_heads(const raw16* qkv, int stride, const KV* k_cache, const KV* v_cache,
                                const unsigned* slot_list, const unsigned* table_off,
                                const int* positions, int heads, int kv_heads, int hd, float scale,
                                raw16* out, float* part_o, float* part_ml,
                                const unsigned* row_list) {
    __shared__ AttnShared sm;
    GRID_DEP_ENTER();
#define ATTN_CASE(LPP)                                                                          \
    case LPP * 8:                                                                               \
        attention_group<LPP>(qkv, stride, k_cache, v_cache, slot_list, table_off, positions,   \
                             heads, kv_heads, scale, out, part_o, part_ml, row_list, sm);      \
        break;
    switch (hd) {
        ATTN_CASE(4)
        ATTN_CASE(8)
        ATTN_CASE(16)
        ATTN_CASE(32)
    }
#undef ATTN_CASE
}
// The entry point NAME of a decode attention kernel for KV cache type KV:
// IMPL(qkv, stride, ...) with the arguments below (`attention` and
// `attention_decode_mma` take the same).
#define DECODE_ATTENTION_KERNEL(NAME, KV, WARPS, MIN_BLOCKS, IMPL)                                \
    extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)                           \
        NAME(const raw16* qkv, int stride, const KV* k_cache, const KV* v_cache,                  \
             const unsigned* slot_list, const unsigned* table_off, const int* positions,          \
             int heads, int kv_heads, int hd, float scale, raw16* out, float* part_o,             \
             float* part_ml, const unsigned* row_list) {                                          \
        IMPL(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, heads, kv_heads, hd,  \
             scale, out, part_o, part_ml, row_list);                                              \
    }
DECODE_ATTENTION_KERNEL(attention, raw16, ATTN_WARPS, 2, attention_heads)
DECODE_ATTENTION_KERNEL(attention_fp8, fp8, ATTN_WARPS, 2, attention_heads)

// Merges the splits of attention: grid = (heads, rows), block >= hd threads;
// block row y is batch row row_list[y] (y when null), as in `attention`.
extern "C" __global__ void attn_merge(const float* part_o, const float* part_ml, int heads, int hd,
                                      int splits, raw16* out, const unsigned* row_list) {
    GRID_DEP_ENTER();
    const size_t ph = (size_t)blockIdx.y * heads + blockIdx.x;
    const size_t rh = (size_t)(row_list ? row_list[blockIdx.y] : blockIdx.y) * heads + blockIdx.x;
    const float* ml = part_ml + ph * splits * 2;
    float big = -NI_INF;
    for (int s = 0; s < splits; s++) big = fmaxf(big, ml[2 * s]);
    float total = 0.f;
    for (int s = 0; s < splits; s++)
        if (ml[2 * s + 1] > 0.f) total += ml[2 * s + 1] * __expf(ml[2 * s] - big);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; s++)
            if (ml[2 * s + 1] > 0.f) o += part_o[(ph * splits + s) * hd + i] * __expf(ml[2 * s] - big);
        out[rh * hd + i] = from_f(total > 0.f ? o / total : 0.f);
    }
}

// Gathers (to_host = 1) or scatters (0) whole KV slots of one layer between
// the cache and a staging buffer [n, 2 * units]: swap-out and swap-in. A
// slot's row is `units` 16-bit words (kv_width elements of raw16, half as
// many words of fp8).
extern "C" __global__ void kv_copy_slots(raw16* k_cache, raw16* v_cache, const unsigned* slots,
                                         raw16* staging, int units, int to_host) {
    GRID_DEP_ENTER();
    const size_t src = (size_t)slots[blockIdx.x] * units;
    raw16* k = staging + (size_t)blockIdx.x * 2 * units;
    raw16* v = k + units;
    for (int i = threadIdx.x; i < units; i += blockDim.x) {
        if (to_host) {
            k[i] = k_cache[src + i];
            v[i] = v_cache[src + i];
        } else {
            k_cache[src + i] = k[i];
            v_cache[src + i] = v[i];
        }
    }
}

#define GEMV_WARPS 4
#define GEMV_MAX_ROWS 8
#ifndef GEMV_PREFETCH_BYTES  // NANOINFER_CUDA_GEMV_PREFETCH overrides it
#define GEMV_PREFETCH_BYTES 2048
#endif

// The weight rows a GEMV streams: 16-bit rows in the activation dtype, or
// FP8 (e4m3) rows with one f32 scale per group of `gcols` columns (a
// row-major [rows, groups] table: block-wise, per-channel and per-tensor
// checkpoints all expand to it). A lane reads a chunk of CHUNK weights per
// 16-byte load; `dot` returns the chunk's dot product with the activations
// `xf`, already scaled. The 16-bit form keeps the plain FMA chain (no
// scale), so its sums are those of the dense kernels before FP8 existed.
struct W16 {
    const raw16* w;
    int k;
    struct Row {
        const raw16* p;
        static constexpr int CHUNK = 8;
        __device__ __forceinline__ void load(int c, float* wf) const {
            unpack8(__ldg((const uint4*)p + c), wf);
        }
        __device__ __forceinline__ float scale(int) const { return 1.f; }  // unused: not scaled
        __device__ __forceinline__ const void* bytes() const { return p; }
    };
    static constexpr int ELEM_BYTES = 2;
    __device__ __forceinline__ Row row(size_t j) const { return Row{w + j * k}; }
};
// Four e4m3 bytes as four floats, exactly: one cvt per pair on sm_89+
// (then half to float), the bit moves of e4m3x2_widen before it.
__device__ __forceinline__ void e4m3x4_to_f32(unsigned w, float* f) {
#if __CUDA_ARCH__ >= 890
    unsigned lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(w & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[0]) : "h"((unsigned short)(lo & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[1]) : "h"((unsigned short)(lo >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[2]) : "h"((unsigned short)(hi & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f[3]) : "h"((unsigned short)(hi >> 16)));
#else
    const unsigned a = e4m3_pair(w, 0), b = e4m3_pair(w, 1);
    f[0] = to_f((raw16)a), f[1] = to_f((raw16)(a >> 16));
    f[2] = to_f((raw16)b), f[3] = to_f((raw16)(b >> 16));
#endif
}
struct W8 {
    const fp8* w;
    int k;
    const float* scales;
    int groups;
    int group_shift;  // log2 of the 16-column chunks per scale group
    struct Row {
        const fp8* p;
        const float* s;
        int group_shift;
        static constexpr int CHUNK = 16;
        __device__ __forceinline__ void load(int c, float* wf) const {
            const uint4 v = __ldg((const uint4*)p + c);
            e4m3x4_to_f32(v.x, wf);
            e4m3x4_to_f32(v.y, wf + 4);
            e4m3x4_to_f32(v.z, wf + 8);
            e4m3x4_to_f32(v.w, wf + 12);
        }
        __device__ __forceinline__ float scale(int c) const { return __ldg(s + (c >> group_shift)); }
        __device__ __forceinline__ const void* bytes() const { return p; }
    };
    static constexpr int ELEM_BYTES = 1;
    __device__ __forceinline__ Row row(size_t j) const {
        return Row{w + j * k, scales + j * groups, group_shift};
    }
};
template <typename Row>
struct ScaledRow {
    static constexpr bool value = false;
};
template <>
struct ScaledRow<W8::Row> {
    static constexpr bool value = true;
};

// Starts pulling the head of a weight row into L2. Weights never depend on
// the previous kernel, so GEMVs issue this before grid_dep_wait: with
// programmatic launch the first weight bytes stream in while the previous
// kernel drains.
__device__ __forceinline__ void prefetch_row(const void* w, int row_bytes) {
    const int lane = threadIdx.x & 31;
    for (int at = lane * 128; at < min(row_bytes, GEMV_PREFETCH_BYTES); at += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)w + at));
}

// acc[i][r] = dot(weight row wr[i], activation row r of x) for W weight rows
// and R activation rows, every lane of the warp getting the full sums. Each
// lane streams 16-byte chunks of the weight rows once; the few activation
// rows come from cache. k must be a multiple of the row's CHUNK. With NORM,
// x holds residual rows and the dot products take rmsnorm(x) * nw instead,
// rounded as add_rms_norm rounds (each warp first sums the squares of its
// rows: cheaper than a separate norm kernel for a decode batch). Scaled
// (FP8) rows sum each chunk apart and add it times the chunk's scale.
template <int R, int W, bool NORM, typename Row>
__device__ __forceinline__ void warp_dots(const raw16* x, const Row (&wr)[W], int k,
                                          float (&acc)[W][R], const raw16* nw, float eps) {
    constexpr int C = Row::CHUNK, V = C / 8;
    constexpr bool SCALED = ScaledRow<Row>::value;
    const int lane = threadIdx.x & 31;
    const int chunks = k / C;
#pragma unroll
    for (int i = 0; i < W; i++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[i][r] = 0.f;
    float rstd[R];
    if (NORM) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            float ss = 0.f;
            for (int c = lane; c < (k >> 3); c += 32) {
                float xf[8];
                unpack8(load_act16((const uint4*)(x + (size_t)r * k) + c), xf);
#pragma unroll
                for (int e = 0; e < 8; e++) ss += xf[e] * xf[e];
            }
            rstd[r] = rsqrtf(warp_sum(ss) / k + eps);
        }
    }
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
        float wf[W][C], nf[C];
#pragma unroll
        for (int i = 0; i < W; i++) wr[i].load(c, wf[i]);
        if (NORM)
#pragma unroll
            for (int v = 0; v < V; v++) unpack8(__ldg((const uint4*)nw + c * V + v), nf + 8 * v);
#pragma unroll
        for (int r = 0; r < R; r++) {
            float xf[C];
#pragma unroll
            for (int v = 0; v < V; v++)
                unpack8(load_act16((const uint4*)(x + (size_t)r * k) + c * V + v), xf + 8 * v);
            if (NORM)
#pragma unroll
                for (int e = 0; e < C; e++) xf[e] = rnd(nf[e] * rnd(xf[e] * rstd[r]));
#pragma unroll
            for (int i = 0; i < W; i++) {
                if (SCALED) {
                    float part = 0.f;
#pragma unroll
                    for (int e = 0; e < C; e++) part += wf[i][e] * xf[e];
                    acc[i][r] += part * wr[i].scale(c);
                } else {
#pragma unroll
                    for (int e = 0; e < C; e++) acc[i][r] += wf[i][e] * xf[e];
                }
            }
        }
    }
    // The weights are read: let the next kernel's blocks launch and start
    // their own prefetch while this grid drains (triggering at entry instead
    // lets waiting blocks take SM slots from this grid's later waves).
    grid_dep_launch();
#pragma unroll
    for (int i = 0; i < W; i++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[i][r] = warp_sum(acc[i][r]);
}

// Instantiates CALL(R) for the runtime row count 2..GEMV_MAX_ROWS.
#define GEMV_ROWS_SWITCH(rows, CALL) \
    switch (rows) {                  \
    case 2: CALL(2); break;          \
    case 3: CALL(3); break;          \
    case 4: CALL(4); break;          \
    case 5: CALL(5); break;          \
    case 6: CALL(6); break;          \
    case 7: CALL(7); break;          \
    case 8: CALL(8); break;          \
    }

// One-row variants of the GEMV kernels: registers are allocated per kernel,
// so batch-1 decode gets kernels sized for one row (more warps per SM).
#define GEMV_ONE_ROW(rows, CALL) CALL(1);

// The body of a GEMV entry point: CALL##_NORM(R) when nw is given, else
// CALL##_PLAIN(R), for the row counts that SWITCH instantiates.
#define GEMV_DISPATCH(SWITCH, rows, nw, CALL) \
    if (nw) {                                 \
        SWITCH(rows, CALL##_NORM)             \
    } else {                                  \
        SWITCH(rows, CALL##_PLAIN)            \
    }

template <int R, bool NORM, typename WT>
__device__ void gemv_rows(const raw16* x, WT w, void* y, int n, int k, int mode, const raw16* nw,
                          float eps) {
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= n) return;
    const typename WT::Row wr[1] = {w.row(j)};
    prefetch_row(wr[0].bytes(), k * WT::ELEM_BYTES);
    grid_dep_wait();
    float acc[1][R];
    warp_dots<R, 1, NORM>(x, wr, k, acc, nw, eps);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const size_t o = (size_t)r * n + j;
            if (mode == GEMV_OUT_F32)
                ((float*)y)[o] = acc[0][r];
            else if (mode == GEMV_OUT_RESIDUAL)
                ((raw16*)y)[o] = from_f(to_f(((raw16*)y)[o]) + rnd(acc[0][r]));
            else  // GEMV_OUT_ACT
                ((raw16*)y)[o] = from_f(acc[0][r]);
        }
    }
}

// The weight operand of a GEMV entry point: W16 from `w`, or (the *_f8
// kernels, whose parameters end with the scale table, its groups per row
// and log2 of the chunks of 16 columns per group) W8.
#define GEMV_W16 W16{(const raw16*)w, k}
#define GEMV_W8 W8{(const fp8*)w, k, w_scales, w_groups, w_group_shift}
#define GEMV_W8_PARAMS , const float *w_scales, int w_groups, int w_group_shift

// y[r, j] = sum_k x[r, k] * w[j, k] for rows r < R <= GEMV_MAX_ROWS (decode
// batches), one weight row per warp; `mode` is a GEMV_OUT_*; with nw, x is
// residual rows normed on the fly (see warp_dots).
// grid = ceil(n / GEMV_WARPS), block = 32 * GEMV_WARPS.
#define GEMV_CALL_PLAIN(R) gemv_rows<R, false>(x, WEIGHT, y, n, k, mode, nw, eps)
#define GEMV_CALL_NORM(R) gemv_rows<R, true>(x, WEIGHT, y, n, k, mode, nw, eps)
#define GEMV_KERNEL(NAME, SWITCH, PARAMS)                                                         \
    extern "C" __global__ void NAME(const raw16* x, const void* w, void* y, int n, int k,         \
                                    int rows, int mode, const raw16* nw, float eps PARAMS) {      \
        GEMV_DISPATCH(SWITCH, rows, nw, GEMV_CALL)                                               \
    }
#define WEIGHT GEMV_W16
GEMV_KERNEL(gemv, GEMV_ROWS_SWITCH, )
GEMV_KERNEL(gemv_r1, GEMV_ONE_ROW, )
#undef WEIGHT
#define WEIGHT GEMV_W8
GEMV_KERNEL(gemv_f8, GEMV_ROWS_SWITCH, GEMV_W8_PARAMS)
GEMV_KERNEL(gemv_f8_r1, GEMV_ONE_ROW, GEMV_W8_PARAMS)
#undef WEIGHT
#undef GEMV_KERNEL
#undef GEMV_CALL_PLAIN
#undef GEMV_CALL_NORM
template <int R, bool NORM, typename WT>
__device__ void gemv_swiglu_rows(const raw16* x, WT w, raw16* out, int inter, int k,
                                 const raw16* nw, float eps) {
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= inter) return;
    const typename WT::Row wr[2] = {w.row(j), w.row((size_t)inter + j)};
    prefetch_row(wr[0].bytes(), k * WT::ELEM_BYTES);
    prefetch_row(wr[1].bytes(), k * WT::ELEM_BYTES);
    grid_dep_wait();
    float acc[2][R];
    warp_dots<R, 2, NORM>(x, wr, k, acc, nw, eps);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
            out[(size_t)r * inter + j] = from_f(silu_mul_f(rnd(acc[0][r]), rnd(acc[1][r])));
    }
}

// The MLP's gate/up projection fused with SwiGLU for decode batches:
// out[r, j] = silu(x[r] · gate[j]) * (x[r] · up[j]), w = [gate; up] stacked
// ([2 * inter, k]). Each warp streams gate row j and up row j. With nw, x is
// residual rows normed on the fly. grid = ceil(inter / GEMV_WARPS), block =
// 32 * GEMV_WARPS.
#define GEMV_CALL_PLAIN(R) gemv_swiglu_rows<R, false>(x, WEIGHT, out, inter, k, nw, eps)
#define GEMV_CALL_NORM(R) gemv_swiglu_rows<R, true>(x, WEIGHT, out, inter, k, nw, eps)
#define GEMV_KERNEL(NAME, SWITCH, PARAMS)                                                         \
    extern "C" __global__ void NAME(const raw16* x, const void* w, raw16* out, int inter, int k,  \
                                    int rows, const raw16* nw, float eps PARAMS) {                \
        GEMV_DISPATCH(SWITCH, rows, nw, GEMV_CALL)                                               \
    }
#define WEIGHT GEMV_W16
GEMV_KERNEL(gemv_swiglu, GEMV_ROWS_SWITCH, )
GEMV_KERNEL(gemv_swiglu_r1, GEMV_ONE_ROW, )
#undef WEIGHT
#define WEIGHT GEMV_W8
GEMV_KERNEL(gemv_swiglu_f8, GEMV_ROWS_SWITCH, GEMV_W8_PARAMS)
GEMV_KERNEL(gemv_swiglu_f8_r1, GEMV_ONE_ROW, GEMV_W8_PARAMS)
#undef WEIGHT
#undef GEMV_KERNEL
#undef GEMV_CALL_PLAIN
#undef GEMV_CALL_NORM
template <int R, bool NORM, typename WT>
__device__ void gemv_qkv_rope_rows(const raw16* x, WT w, const raw16* bias, raw16* qkv,
                                   const float2* cs, const unsigned* slots, void* k_cache,
                                   void* v_cache, int nq, int nkv, int hd, int k,
                                   const raw16* nw, float eps, bool kv_fp8) {
    const int u = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int half = hd / 2, width = nq + 2 * nkv, rope_units = (nq + nkv) / 2;
    if (u >= width / 2) return;
    // A rope unit is the pair (i, i + half) of one q or k head; the other
    // units are adjacent pairs of v columns.
    int a, freq = -1;
    if (u < rope_units) {
        freq = u % half;
        a = (u / half) * hd + freq;
    } else {
        a = nq + nkv + 2 * (u - rope_units);
    }
    const int b = freq >= 0 ? a + half : a + 1;
    const typename WT::Row wr[2] = {w.row(a), w.row(b)};
    prefetch_row(wr[0].bytes(), k * WT::ELEM_BYTES);
    prefetch_row(wr[1].bytes(), k * WT::ELEM_BYTES);
    grid_dep_wait();
    float acc[2][R];
    warp_dots<R, 2, NORM>(x, wr, k, acc, nw, eps);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int r = 0; r < R; r++)
        qkv_pair_store(acc[0][r], acc[1][r], r, a, b, freq, bias, qkv, cs, slots, k_cache, v_cache,
                       nq, nkv, hd, kv_fp8);
}

// The QKV projection fused with bias, RoPE and the KV-cache write for decode
// batches (models without q/k norms): q goes to the QKV rows (stride nq +
// 2 * nkv), k and v straight to slot slots[r] of the layer's caches. Each
// warp streams the two weight rows of one rope pair or two v columns.
// kv_fp8: the caches hold fp8. grid = ceil((nq + 2 * nkv) / 2 / GEMV_WARPS),
// block = 32 * GEMV_WARPS.
#define GEMV_CALL_PLAIN(R)                                                                        \
    gemv_qkv_rope_rows<R, false>(x, WEIGHT, bias, qkv, cs, slots, k_cache, v_cache, nq, nkv, hd, \
                                 k, nw, eps, kv_fp8)
#define GEMV_CALL_NORM(R)                                                                        \
    gemv_qkv_rope_rows<R, true>(x, WEIGHT, bias, qkv, cs, slots, k_cache, v_cache, nq, nkv, hd, \
                                k, nw, eps, kv_fp8)
#define GEMV_KERNEL(NAME, SWITCH, PARAMS)                                                          \
    extern "C" __global__ void NAME(const raw16* x, const void* w, const raw16* bias, raw16* qkv,  \
                                    const float2* cs, const unsigned* slots, void* k_cache,        \
                                    void* v_cache, int nq, int nkv, int hd, int k, int rows,       \
                                    const raw16* nw, float eps, int kv_fp8 PARAMS) {               \
        GEMV_DISPATCH(SWITCH, rows, nw, GEMV_CALL)                                                \
    }
#define WEIGHT GEMV_W16
GEMV_KERNEL(gemv_qkv_rope, GEMV_ROWS_SWITCH, )
GEMV_KERNEL(gemv_qkv_rope_r1, GEMV_ONE_ROW, )
#undef WEIGHT
#define WEIGHT GEMV_W8
GEMV_KERNEL(gemv_qkv_rope_f8, GEMV_ROWS_SWITCH, GEMV_W8_PARAMS)
GEMV_KERNEL(gemv_qkv_rope_f8_r1, GEMV_ONE_ROW, GEMV_W8_PARAMS)
#undef WEIGHT
#undef GEMV_KERNEL
#undef GEMV_CALL_PLAIN
#undef GEMV_CALL_NORM

// FP8 weights as activation-dtype rows, for products that go through
// cuBLAS (prefill, batches above the GEMV's rows): out[j, c] = q[j, c] ·
// scale of its group, rounded once. One thread per 8 columns.
extern "C" __global__ void fp8_dequant(const fp8* w, const float* scales, int rows, int k,
                                       int groups, int gcols, raw16* out) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t runs = (size_t)rows * (k / 8);
    if (i >= runs) return;
    const size_t j = i / (k / 8), c = (i % (k / 8)) * 8;
    float f[8];
    unpack8(e4m3x8_widen(__ldg((const uint2*)(w + j * k + c))), f);
    const float s = __ldg(scales + j * groups + c / gcols);
    *(uint4*)(out + j * k + c) = make_uint4(pack2(f[0] * s, f[1] * s), pack2(f[2] * s, f[3] * s),
                                            pack2(f[4] * s, f[5] * s), pack2(f[6] * s, f[7] * s));
}

#define TILE_ROWS 16
#define TILE_KEYS 32
#define TILE_WARPS 4
#define ROWS_PER_WARP (TILE_ROWS / TILE_WARPS)
#define TILE_HD_MAX 128  // head_dim <= 128 (larger heads use `attention`)
#define TILE_PER_LANE (TILE_HD_MAX / 32)
#define KV_PAD 2  // keeps lanes reading different key rows on different banks

// Causal attention for prefill: one block per (head, tile), a tile being up
// to TILE_ROWS consecutive rows of one sequence (rows tile_row[t] ..
// + tile_n[t]). Blocks of TILE_KEYS cached positions are staged in shared
// memory once and used by every row of the tile, instead of once per row.
// Each warp owns ROWS_PER_WARP rows; lane j scores position j of the key
// block, and owns output dims lane + 32 e. grid = (heads, tiles),
// block = 32 * TILE_WARPS. attention_tiles_fp8 reads an FP8 cache.
template <typename KV>
__device__ void attention_tile_rows(const raw16* qkv, int stride, const KV* k_cache,
                                    const KV* v_cache, const unsigned* slot_list,
                                    const unsigned* table_off, const int* positions,
                                    const unsigned* tile_row, const unsigned* tile_n, int heads,
                                    int kv_heads, int hd, float scale, raw16* out) {
    GRID_DEP_ENTER();
    __shared__ float q_s[TILE_ROWS][TILE_HD_MAX];
    __shared__ raw16 k_s[TILE_KEYS][TILE_HD_MAX + KV_PAD];
    __shared__ raw16 v_s[TILE_KEYS][TILE_HD_MAX + KV_PAD];
    const int head = blockIdx.x, t = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int per_lane = hd >> 5;
    const int kv_head = head / (heads / kv_heads);
    const int kv_width = kv_heads * hd;
    const int row0 = tile_row[t], n = tile_n[t];
    const unsigned* slots = slot_list + table_off[row0];
    const int last = positions[row0 + n - 1];

    for (int i = threadIdx.x; i < TILE_ROWS * hd; i += blockDim.x) {
        const int r = i / hd, d = i % hd;
        q_s[r][d] = r < n ? to_f(qkv[(size_t)(row0 + r) * stride + head * hd + d]) * scale : 0.f;
    }
    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][TILE_PER_LANE];
    int pos[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; i++) {
        const int r = warp * ROWS_PER_WARP + i;
        pos[i] = r < n ? positions[row0 + r] : -1;
        m[i] = -NI_INF;
        l[i] = 0.f;
#pragma unroll
        for (int e = 0; e < TILE_PER_LANE; e++) acc[i][e] = 0.f;
    }
    for (int kb = 0; kb <= last; kb += TILE_KEYS) {
        __syncthreads();  // the previous block's keys are no longer read
        for (int i = threadIdx.x; i < TILE_KEYS * hd; i += blockDim.x) {
            const int j = i / hd, d = i % hd, p = kb + j;
            raw16 kv = 0, vv = 0;
            if (p <= last) {
                const size_t base = (size_t)slots[p] * kv_width + kv_head * hd + d;
                kv = kv_raw16(k_cache[base]);
                vv = kv_raw16(v_cache[base]);
            }
            k_s[j][d] = kv;
            v_s[j][d] = vv;
        }
        __syncthreads();
        float s[ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; i++) s[i] = 0.f;
        const int r0 = warp * ROWS_PER_WARP;
        for (int d = 0; d < hd; d++) {
            const float kd = to_f(k_s[lane][d]);
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; i++) s[i] += q_s[r0 + i][d] * kd;
        }
        const int p = kb + lane;
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; i++) {
            if (pos[i] < kb) continue;  // row absent, or this block is past its causal window
            const float sc = p <= pos[i] ? s[i] : -NI_INF;
            float bm = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
            const float m_new = fmaxf(m[i], bm);
            const float corr = __expf(m[i] - m_new);
            const float w = p <= pos[i] ? __expf(sc - m_new) : 0.f;
            l[i] = l[i] * corr + warp_sum(w);
#pragma unroll
            for (int e = 0; e < TILE_PER_LANE; e++) acc[i][e] *= corr;
            for (int j = 0; j < TILE_KEYS; j++) {
                const float wj = __shfl_sync(0xffffffffu, w, j);
#pragma unroll
                for (int e = 0; e < TILE_PER_LANE; e++)
                    if (e < per_lane) acc[i][e] += wj * to_f(v_s[j][lane + 32 * e]);
            }
            m[i] = m_new;
        }
    }
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; i++) {
        if (pos[i] < 0) continue;
        const int r = row0 + warp * ROWS_PER_WARP + i;
        raw16* o = out + (size_t)r * heads * hd + head * hd;
#pragma unroll
        for (int e = 0; e < TILE_PER_LANE; e++)
            if (e < per_lane) o[lane + 32 * e] = from_f(l[i] > 0.f ? acc[i][e] / l[i] : 0.f);
    }
}

#define ATTENTION_TILES_KERNEL(NAME, KV)                                                            \
    extern "C" __global__ void NAME(const raw16* qkv, int stride, const KV* k_cache,                \
                                    const KV* v_cache, const unsigned* slot_list,                   \
                                    const unsigned* table_off, const int* positions,                \
                                    const unsigned* tile_row, const unsigned* tile_n, int heads,    \
                                    int kv_heads, int hd, float scale, raw16* out) {                \
        attention_tile_rows(qkv, stride, k_cache, v_cache, slot_list, table_off, positions,        \
                            tile_row, tile_n, heads, kv_heads, hd, scale, out);                    \
    }
ATTENTION_TILES_KERNEL(attention_tiles, raw16)
ATTENTION_TILES_KERNEL(attention_tiles_fp8, fp8)
#undef ATTENTION_TILES_KERNEL

// ---- Prefill attention on tensor cores (sm_80+) ----
#define FA_ROWS 64  // query rows per block, 16 per warp
#define FA_KEYS 64  // keys per shared-memory tile
#define FA_WARPS 4
#define FA_PAD 8  // row padding (elements): fragment loads hit 32 distinct banks
#ifndef FA_MIN_BLOCKS
#define FA_MIN_BLOCKS 2  // blocks per SM the register budget must allow
#endif

// Gathers key or value tiles of cached positions kb .. kb + FA_KEYS - 1 of
// one kv head into shared memory for flash_tile (positions past `last` are
// zero): `start` begins a tile, `land` finishes it before the block's
// barrier. A 16-bit cache is copied by cp.async (land waits for it). An
// FP8 cache is loaded into registers by start and widened into shared
// memory by land, so its loads, too, are in flight while the warps compute.
template <int HD, typename KV>
struct FlashStager;

template <int HD>
struct FlashStager<HD, raw16> {
    __device__ __forceinline__ void start(raw16 (*dst)[HD + FA_PAD], const raw16* cache,
                                          const unsigned* slots, int kb, int last, int kv_width,
                                          int kv_col) {
        for (int i = threadIdx.x; i < FA_KEYS * HD / 8; i += 32 * FA_WARPS) {
            const int j = i / (HD / 8), c = (i % (HD / 8)) * 8, p = kb + j;
            const bool ok = p <= last;
            const raw16* src = ok ? cache + (size_t)slots[p] * kv_width + kv_col + c : cache;
            cp_async16(&dst[j][c], src, ok ? 16 : 0);
        }
        cp_async_commit();
    }
    __device__ __forceinline__ void land() { cp_async_wait_all(); }
};

template <int HD>
struct FlashStager<HD, fp8> {
    static constexpr int LOADS = FA_KEYS * HD / 16 / (32 * FA_WARPS);  // 16-byte loads per thread
    uint4 r[LOADS];
    raw16 (*dst)[HD + FA_PAD];

    __device__ __forceinline__ void start(raw16 (*tile)[HD + FA_PAD], const fp8* cache,
                                          const unsigned* slots, int first, int last,
                                          int kv_width, int kv_col) {
        dst = tile;
#pragma unroll
        for (int n = 0; n < LOADS; n++) {
            const int i = threadIdx.x + n * 32 * FA_WARPS;
            const int j = i / (HD / 16), c = (i % (HD / 16)) * 16, p = first + j;
            r[n] = p <= last ? *(const uint4*)(cache + (size_t)slots[p] * kv_width + kv_col + c)
                             : make_uint4(0, 0, 0, 0);
        }
    }
    __device__ __forceinline__ void land() {
#pragma unroll
        for (int n = 0; n < LOADS; n++) {
            const int i = threadIdx.x + n * 32 * FA_WARPS;
            const int j = i / (HD / 16), c = (i % (HD / 16)) * 16;
            *(uint4*)&dst[j][c] = e4m3x8_widen(make_uint2(r[n].x, r[n].y));
            *(uint4*)&dst[j][c + 8] = e4m3x8_widen(make_uint2(r[n].z, r[n].w));
        }
    }
};

// Causal attention for prefill, flash-attention style on tensor cores: one
// block per (head, tile), a tile being up to FA_ROWS consecutive rows of one
// sequence (rows tile_row[t] .. + tile_n[t]); warp w owns rows 16w .. 16w+15.
// Key/value tiles of FA_KEYS cached positions are gathered through the slot
// list into shared memory by cp.async, the values while S = Q Kᵀ runs and the
// next keys while O += P V runs; both products are m16n8k16 MMAs fed by
// ldmatrix, with an online softmax in between (P rounded to the activation
// dtype, as flash-attention does). Only tiles that reach past a warp's first
// row are masked. Lane layout: g = lane / 4 picks fragment rows g and g + 8,
// t = lane % 4 the column pairs 2t, 2t + 1.
template <int HD, typename KV>
__device__ void flash_tile(const raw16* qkv, int stride, const KV* k_cache,
                           const KV* v_cache, const unsigned* slot_list,
                           const unsigned* table_off, const int* positions,
                           const unsigned* tile_row, const unsigned* tile_n, int heads,
                           int kv_heads, float scale, raw16* out, raw16 (*ks)[HD + FA_PAD],
                           raw16 (*vs)[HD + FA_PAD]) {
    // The causal tiles late in a sequence are the longest: they start first.
    const int head = blockIdx.x, t = gridDim.y - 1 - blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int kv_head = head / (heads / kv_heads);
    const int kv_width = kv_heads * HD, kv_col = kv_head * HD;
    const int row0 = tile_row[t], n = tile_n[t];
    const unsigned* slots = slot_list + table_off[row0];
    const int last = positions[row0 + n - 1];
    const int ra = warp * 16 + g, rb = ra + 8;
    const int pa = ra < n ? positions[row0 + ra] : -1;
    const int pb = rb < n ? positions[row0 + rb] : -1;
    // Positions grow along the tile: the warp's first and last rows bound it.
    const int warp_first = warp * 16 < n ? positions[row0 + warp * 16] : -1;
    const int warp_last = warp * 16 < n ? positions[row0 + min(n, warp * 16 + 16) - 1] : -1;

    FlashStager<HD, KV> stage;
    stage.start(ks, k_cache, slots, 0, last, kv_width, kv_col);
    unsigned qf[HD / 16][4];
    {
        const raw16* qa = qkv + (size_t)(row0 + ra) * stride + head * HD;
        const raw16* qb = qkv + (size_t)(row0 + rb) * stride + head * HD;
#pragma unroll
        for (int s = 0; s < HD / 16; s++) {
            const int c = s * 16 + 2 * tq;
            qf[s][0] = pa >= 0 ? *(const unsigned*)(qa + c) : 0u;
            qf[s][1] = pb >= 0 ? *(const unsigned*)(qb + c) : 0u;
            qf[s][2] = pa >= 0 ? *(const unsigned*)(qa + c + 8) : 0u;
            qf[s][3] = pb >= 0 ? *(const unsigned*)(qb + c + 8) : 0u;
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    float o[HD / 8][4];
#pragma unroll
    for (int d = 0; d < HD / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m_a = -NI_INF, m_b = -NI_INF, l_a = 0.f, l_b = 0.f;
    // ldmatrix row addresses of this lane: keys (row) and dims (column)
    // within a fragment group; see the two products below.
    const int k_row = lane & 7, k_col = (lane >> 3) * 8;
    const int v_row = (lane & 7) + ((lane >> 3) & 1) * 8, v_col = (lane >> 4) * 8;

    for (int kb = 0; kb <= last; kb += FA_KEYS) {
        stage.land();
        __syncthreads();  // keys kb.. landed; no warp still reads the previous values
        stage.start(vs, v_cache, slots, kb, last, kv_width, kv_col);
        const bool active = kb <= warp_last;  // warp-uniform
        float s[FA_KEYS / 8][4];
        if (active) {
            // S = Q Kᵀ: one ldmatrix gives key rows nt*8.. at dims 32kp..32kp+31,
            // the B fragments of k-steps 2kp and 2kp + 1.
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; nt++) {
                s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
                for (int kp = 0; kp < HD / 32; kp++) {
                    unsigned b[4];
                    ldmatrix_x4<false>(b, &ks[nt * 8 + k_row][kp * 32 + k_col]);
                    mma16816(s[nt], qf[2 * kp], b[0], b[1]);
                    mma16816(s[nt], qf[2 * kp + 1], b[2], b[3]);
                }
            }
            // Scores in base 2, then the causal mask (only where the tile
            // reaches past the warp's first row) and the running maxima of
            // rows a, b. The rounding steps (scale first, sums in key order)
            // are kept as they were before the kernel was pipelined: greedy
            // tokens of tiny random models flip on a last-bit change.
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[nt][e] *= scale_log2;
            if (kb + FA_KEYS - 1 > warp_first) {
#pragma unroll
                for (int nt = 0; nt < FA_KEYS / 8; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        const int key = kb + nt * 8 + 2 * tq + (e & 1);
                        if (key > (e < 2 ? pa : pb)) s[nt][e] = -NI_INF;
                    }
            }
            float mx_a = m_a, mx_b = m_b;
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; nt++) {
                mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
            }
#pragma unroll
            for (int o_ = 1; o_ < 4; o_ <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, o_));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, o_));
            }
            // Rows with nothing unmasked yet keep max -inf: no correction, p = 0.
            const float corr_a = mx_a == -NI_INF ? 1.f : exp2f(m_a - mx_a);
            const float corr_b = mx_b == -NI_INF ? 1.f : exp2f(m_b - mx_b);
            m_a = mx_a;
            m_b = mx_b;
            const float sub_a = mx_a == -NI_INF ? 0.f : mx_a;
            const float sub_b = mx_b == -NI_INF ? 0.f : mx_b;
            float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; nt++) {
                s[nt][0] = exp2f(s[nt][0] - sub_a);
                sum_a += s[nt][0];
                s[nt][1] = exp2f(s[nt][1] - sub_a);
                sum_a += s[nt][1];
                s[nt][2] = exp2f(s[nt][2] - sub_b);
                sum_b += s[nt][2];
                s[nt][3] = exp2f(s[nt][3] - sub_b);
                sum_b += s[nt][3];
            }
            l_a = l_a * corr_a + sum_a;
            l_b = l_b * corr_b + sum_b;
#pragma unroll
            for (int d = 0; d < HD / 8; d++) {
                o[d][0] *= corr_a;
                o[d][1] *= corr_a;
                o[d][2] *= corr_b;
                o[d][3] *= corr_b;
            }
        }
        stage.land();
        __syncthreads();  // values landed; no warp still reads these keys
        if (kb + FA_KEYS <= last) stage.start(ks, k_cache, slots, kb + FA_KEYS, last, kv_width, kv_col);
        if (!active) continue;
        // O += P V: the S accumulators of key tiles 2k, 2k+1 are the A
        // fragment of k-step k; one transposed ldmatrix gives the B
        // fragments of dims 16dp.. and 16dp + 8.. over those 16 keys.
#pragma unroll
        for (int k16 = 0; k16 < FA_KEYS / 16; k16++) {
            const unsigned a[4] = {pack2(s[2 * k16][0], s[2 * k16][1]),
                                   pack2(s[2 * k16][2], s[2 * k16][3]),
                                   pack2(s[2 * k16 + 1][0], s[2 * k16 + 1][1]),
                                   pack2(s[2 * k16 + 1][2], s[2 * k16 + 1][3])};
#pragma unroll
            for (int dp = 0; dp < HD / 16; dp++) {
                unsigned b[4];
                ldmatrix_x4<true>(b, &vs[k16 * 16 + v_row][dp * 16 + v_col]);
                mma16816(o[2 * dp], a, b[0], b[1]);
                mma16816(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
    }
    // Each lane summed a quarter of its rows' columns.
#pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, o_);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, o_);
    }
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
    raw16* oa = out + (size_t)(row0 + ra) * heads * HD + head * HD;
    raw16* ob = out + (size_t)(row0 + rb) * heads * HD + head * HD;
#pragma unroll
    for (int d = 0; d < HD / 8; d++) {
        const int c = d * 8 + 2 * tq;
        if (pa >= 0) *(unsigned*)(oa + c) = pack2(o[d][0] * inv_a, o[d][1] * inv_a);
        if (pb >= 0) *(unsigned*)(ob + c) = pack2(o[d][2] * inv_b, o[d][3] * inv_b);
    }
}

// head_dim 64 or 128 (the host checks); grid = (heads, tiles), block = 32 * FA_WARPS.
// attention_flash_fp8 reads an FP8 cache.
template <typename KV>
__device__ void flash_heads(const raw16* qkv, int stride, const KV* k_cache, const KV* v_cache,
                            const unsigned* slot_list, const unsigned* table_off,
                            const int* positions, const unsigned* tile_row, const unsigned* tile_n,
                            int heads, int kv_heads, int hd, float scale, raw16* out) {
    __shared__ __align__(16) raw16 ks[FA_KEYS * (128 + FA_PAD)];
    __shared__ __align__(16) raw16 vs[FA_KEYS * (128 + FA_PAD)];
    GRID_DEP_ENTER();
    if (hd == 128)
        flash_tile<128>(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, tile_row,
                        tile_n, heads, kv_heads, scale, out, (raw16(*)[128 + FA_PAD])ks,
                        (raw16(*)[128 + FA_PAD])vs);
    else
        flash_tile<64>(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, tile_row,
                       tile_n, heads, kv_heads, scale, out, (raw16(*)[64 + FA_PAD])ks,
                       (raw16(*)[64 + FA_PAD])vs);
}
#define FLASH_KERNEL(NAME, KV)                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * FA_WARPS, FA_MIN_BLOCKS)                      \
        NAME(const raw16* qkv, int stride, const KV* k_cache, const KV* v_cache,                   \
             const unsigned* slot_list, const unsigned* table_off, const int* positions,           \
             const unsigned* tile_row, const unsigned* tile_n, int heads, int kv_heads, int hd,    \
             float scale, raw16* out) {                                                            \
        flash_heads(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, tile_row,      \
                    tile_n, heads, kv_heads, hd, scale, out);                                      \
    }
FLASH_KERNEL(attention_flash, raw16)
FLASH_KERNEL(attention_flash_fp8, fp8)
#undef FLASH_KERNEL

// ---- Decode attention on tensor cores (sm_80+) ----
#define DA_WARPS 4
#define DA_GROUP_MAX 8  // query heads per kv head: rows 0..7 of the MMAs
#ifndef DA_MIN_BLOCKS
#define DA_MIN_BLOCKS 2
#endif
#ifndef DA_FP8_KEY_BLOCKS
// 16-key blocks per warp step of attention_decode_mma_fp8 (1 or 2; 2 doubles
// the ring's step, so it needs DA_FP8_STAGES 1, or 0 for register loads)
#define DA_FP8_KEY_BLOCKS 1
#endif
#ifndef DA_FP8_STAGES
#define DA_FP8_STAGES 3  // warp steps of attention_decode_mma_fp8 in flight (0: register loads)
#endif
#ifndef DA_FP8_MIN_BLOCKS
#define DA_FP8_MIN_BLOCKS (DA_FP8_STAGES ? 3 : DA_MIN_BLOCKS)
#endif

struct DecodeShared {
    float m[DA_WARPS][DA_GROUP_MAX], l[DA_WARPS][DA_GROUP_MAX];
    float o[DA_WARPS][128];
};

// The staged decode kernel's ring: each warp's DA_FP8_STAGES steps of keys
// and values (head_dim <= 128) in shared memory. A step holds its keys' rows
// of HD values, then its values' rows. Unswizzled: the fragment reads below
// meet 2- to 4-way bank conflicts, but shared memory has ~10x the bandwidth
// this kernel draws from DRAM, and plain offsets keep the addresses in
// immediates instead of registers.
template <typename KV>
struct DecodeRing {
    static constexpr bool on = sizeof(KV) == 1 && DA_FP8_STAGES > 0;
    static constexpr int keys = 16 * (sizeof(KV) == 1 ? DA_FP8_KEY_BLOCKS : 1);
    static constexpr int step_bytes = 2 * keys * 128 * (int)sizeof(KV);
    static constexpr int bytes = on ? DA_WARPS * DA_FP8_STAGES * step_bytes : 0;
    // Byte offset of byte `b` of key `r`'s row (values: `value`) in a step.
    template <int HD>
    __device__ static __forceinline__ int at(int r, int b, bool value) {
        return ((value ? keys : 0) + r) * HD * (int)sizeof(KV) + b;
    }
};
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// `n` 32-bit words from p (16-byte aligned, or 8-byte for n = 2).
template <int N>
__device__ __forceinline__ void load_words(unsigned* w, const void* p, bool ok) {
    if constexpr (N == 2) {
        const uint2 v = ok ? *(const uint2*)p : make_uint2(0, 0);
        w[0] = v.x, w[1] = v.y;
    } else {
#pragma unroll
        for (int i = 0; i < N / 4; i++) {
            const uint4 v = ok ? ((const uint4*)p)[i] : make_uint4(0, 0, 0, 0);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    }
}

// Decode attention with the GQA group's query heads as the rows of m16n8k16
// MMAs: one block serves every query head of one kv head for one row and one
// split of its context (positions as in `attention`), so each key and value
// is read once, by one warp; a warp step takes KEYS = 16 KB keys (KB = 1;
// DA_FP8_KEY_BLOCKS for fp8), warp w keys KEYS w.., KEYS (w + 4).., ... of
// the split. A 16-bit cache is not staged in shared memory: each lane loads
// its fragments straight from the cache in 16-byte pieces, which fixes how it
// sees the head dims. (A second register buffer, loading the next step while
// one computes, was no faster: 255 registers, and occupancy already hides the
// latency.) An FP8 cache, half the bytes for the same work, left that kernel
// latency-bound (~1.6 TB/s on an H100), so it streams through a ring of
// DA_FP8_STAGES steps per warp in shared memory (DecodeRing, cp.async), and
// each lane reads the same fragments from there.
// - S = Q Kᵀ sums over the head dims in any order, so lane (g, t) holds runs
//   t, t + 4, ... of keys g, g + 8, ... (a run: the 16 bytes of 8 dims of
//   raw16, of 16 dims of fp8), and the Q fragments take the same dims of
//   their rows.
// - O += P V, one k-step per 16 keys: lane (g, t) loads the same dims of its
//   four keys of each (2t, 2t + 1, 2t + 8, 2t + 9) and pairs them with a
//   byte permute. raw16: 16-byte runs 8c + g, so n-tile j and fragment
//   column c are dim 64 (j / 8) + 8c + j % 8; fp8: dims g HD / 8 .., so they
//   are dim c HD / 8 + j.
// An FP8 cache (KV = fp8) is widened to the activation dtype in registers.
// Its fragments take half the registers, so a step may take twice the keys
// (DA_FP8_KEY_BLOCKS 2: the bytes in flight of raw16, 203 registers): with
// register loads the kernel ran 12 % faster, but offline throughput did not
// rise (H100); the ring (below) made it 20 % faster and raised throughput.
// Warps merge through shared memory at the end; with one split the result
// goes to `out`, otherwise (max, sum) and the unnormalized sums go to part_ml
// and part_o for attn_merge (the max in natural-log units, as `attention`).
// grid = (kv_heads, rows, splits), block = 32 * DA_WARPS.
template <int HD, typename KV>
__device__ void decode_mma(const raw16* qkv, int stride, const KV* k_cache, const KV* v_cache,
                           const unsigned* slot_list, const unsigned* table_off,
                           const int* positions, int heads, int kv_heads, float scale,
                           raw16* out, float* part_o, float* part_ml, const unsigned* row_list,
                           unsigned char* smem) {
    DecodeShared& sm = *reinterpret_cast<DecodeShared*>(smem);
    constexpr bool FP8 = sizeof(KV) == 1;
    constexpr int KB = FP8 ? DA_FP8_KEY_BLOCKS : 1;  // 16-key blocks per warp step
    constexpr int KEYS = 16 * KB;
    constexpr int RUN = 16 / sizeof(KV);      // dims of a 16-byte run
    constexpr int KW = HD * sizeof(KV) / 16;  // words of a key per lane (HD / 4 lanes)
    constexpr int VW = HD * sizeof(KV) / 32;  // words of a value per lane
    constexpr int KS = HD / 16;               // k-steps of S
    constexpr int NT = HD / 8;                // n-tiles of O
    const int group = heads / kv_heads;
    const int kv_head = blockIdx.x, h0 = kv_head * group;
    const int prow = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int row = row_list ? row_list[prow] : prow;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, tq = lane & 3;
    const int kv_width = kv_heads * HD;
    // Written before the step (host uploads, earlier steps' keys): read
    // before waiting for the previous kernel.
    const int n = positions[row] + 1;
    const int chunk = (n + splits - 1) / splits;
    const int begin = split * chunk, end = min(n, begin + chunk);
    const unsigned* slots = slot_list + table_off[row];
    const KV* k_head = k_cache + kv_head * HD;
    const KV* v_head = v_cache + kv_head * HD;

    // Fragments of keys kb .. kb + KEYS - 1: K rows g, g + 8, ..., V rows of
    // the lane's four keys of each 16; keys from `limit` on are zero.
    auto load = [&](unsigned (&kw)[2 * KB][KW], unsigned (&vw)[4 * KB][VW], int kb, int limit) {
        const int mine = kb + (lane & (KEYS - 1));
        const unsigned sl = mine < limit ? slots[mine] : 0u;
#pragma unroll
        for (int j = 0; j < 2 * KB; j++) {
            const int key = 8 * j + g;
            const KV* src = k_head + (size_t)__shfl_sync(0xffffffffu, sl, key) * kv_width;
#pragma unroll
            for (int i = 0; i < KW / 4; i++)
                load_words<4>(&kw[j][4 * i], src + (tq + 4 * i) * RUN, kb + key < limit);
        }
#pragma unroll
        for (int r = 0; r < 4 * KB; r++) {
            const int key = 16 * (r / 4) + 2 * tq + (r & 1) + 8 * ((r >> 1) & 1);
            const KV* src = v_head + (size_t)__shfl_sync(0xffffffffu, sl, key) * kv_width;
            if constexpr (FP8) {
                load_words<VW>(vw[r], src + g * (HD / 8), kb + key < limit);
            } else {
#pragma unroll
                for (int c = 0; c < VW / 4; c++)
                    load_words<4>(&vw[r][4 * c], src + (8 * c + g) * 8, kb + key < limit);
            }
        }
    };
    // Staged (an FP8 cache): the warp's steps t = 0, 1, ... go through its
    // ring of S steps in shared memory by asynchronous copies, S steps ahead
    // of the one it attends.
    using Ring = DecodeRing<KV>;
    constexpr int S = Ring::on ? DA_FP8_STAGES : 1;
    constexpr int CH = HD * sizeof(KV) / 16;  // 16-byte chunks of a row
    unsigned char* const ring = smem + warp * S * Ring::step_bytes;
    const int first_key = begin + KEYS * warp;  // the warp's; its step t starts KEYS DA_WARPS t later
    // Copies step t's keys and values into its ring slot: lane l copies
    // chunks l / KEYS, l / KEYS + 32 / KEYS, ... of key l % KEYS, whose cache
    // slot is `slot` (slot_of, loaded a step early so that its latency does
    // not hold up the copies). Keys past `end` are zeroed (P V must not meet
    // stale bytes). Before the wait it leaves out the newest key (n - 1),
    // which the previous kernel (the QKV projection) writes; `only` >= 0
    // copies that one key alone.
    auto slot_of = [&](int t) {
        const int pos = first_key + t * KEYS * DA_WARPS + lane % KEYS;
        return pos < end ? slots[pos] : 0u;
    };
    auto issue = [&](int t, unsigned slot, bool before_wait, int only) {
        const int key = lane % KEYS, pos = first_key + t * KEYS * DA_WARPS + key;
        const bool real = pos < end && (only < 0 ? !(before_wait && pos == n - 1) : pos == only);
        if (!real && (pos < end || only >= 0)) return;
        const size_t at = real ? (size_t)slot * kv_width : 0;
        const int bytes = real ? 16 : 0;
        unsigned char* const step = ring + (t % S) * Ring::step_bytes;
#pragma unroll
        for (int i = 0; i < CH * KEYS / 32; i++) {
            const int c = lane / KEYS + (32 / KEYS) * i;
            cp_async16(step + Ring::template at<HD>(key, 16 * c, false), k_head + at + c * RUN, bytes);
            cp_async16(step + Ring::template at<HD>(key, 16 * c, true), v_head + at + c * RUN, bytes);
        }
    };
    // Step t's fragments from the ring, laid out as `load` lays them out:
    // the keys', then (fetch_values) the values'.
    auto fetch_keys = [&](unsigned (&kw)[2 * KB][KW], int t) {
        const unsigned char* const step = ring + (t % S) * Ring::step_bytes;
#pragma unroll
        for (int j = 0; j < 2 * KB; j++)
#pragma unroll
            for (int i = 0; i < KW / 4; i++)
                load_words<4>(&kw[j][4 * i], step + Ring::template at<HD>(8 * j + g, 16 * (tq + 4 * i), false),
                              true);
    };
    auto fetch_values = [&](unsigned (&vw)[4 * KB][VW], int t) {
        const unsigned char* const step = ring + (t % S) * Ring::step_bytes;
#pragma unroll
        for (int r = 0; r < 4 * KB; r++) {
            const int key = 16 * (r / 4) + 2 * tq + (r & 1) + 8 * ((r >> 1) & 1);
            if constexpr (FP8) {
                load_words<VW>(vw[r], step + Ring::template at<HD>(key, g * (HD / 8), true), true);
            } else {
#pragma unroll
                for (int c = 0; c < VW / 4; c++)
                    load_words<4>(&vw[r][4 * c], step + Ring::template at<HD>(key, 16 * (8 * c + g), true), true);
            }
        }
    };

    // The warp's first keys are requested before the wait, all but the
    // newest (n - 1), which the previous kernel (the QKV projection) writes.
    int kb = first_key;
    const int steps = kb < end ? (end - kb + KEYS * DA_WARPS - 1) / (KEYS * DA_WARPS) : 0;
    int fixed_step = -1;  // staged: the step whose newest key was copied after the wait
    unsigned kw[2 * KB][KW], vw[4 * KB][VW];
    if constexpr (Ring::on) {
        // Commit groups: one per step, the last prologue step's after the wait.
        unsigned first[S];
#pragma unroll
        for (int t = 0; t < S; t++) first[t] = slot_of(t);
#pragma unroll
        for (int t = 0; t < S; t++) {
            if (t < steps) issue(t, first[t], true, -1);
            if (t < S - 1) cp_async_commit();
        }
    } else if (kb < end) {
        load(kw, vw, kb, min(end, n - 1));
    }
    grid_dep_wait();
    if constexpr (Ring::on) {
        const int newest = n - 1 - begin;
        if (n - 1 < end && newest >= 0 && (newest / KEYS) % DA_WARPS == warp &&
            newest / (KEYS * DA_WARPS) < S) {
            fixed_step = newest / (KEYS * DA_WARPS);
            issue(fixed_step, slots[n - 1], false, n - 1);
        }
        cp_async_commit();
    } else if (kb <= n - 1 && n - 1 < min(end, kb + KEYS)) {
        load(kw, vw, kb, end);
    }

    // Q: fragment row g is query head g of the group (rows 8..15 are zero),
    // in the lane's order of the dims.
    unsigned qa[KS][4];
    {
        unsigned w[2 * KS];
        const raw16* q = qkv + (size_t)row * stride + (size_t)(h0 + g) * HD;
#pragma unroll
        for (int i = 0; i < HD / (4 * RUN); i++)
#pragma unroll
            for (int c = 0; c < RUN / 8; c++)
                load_words<4>(&w[4 * (RUN / 8) * i + 4 * c], q + (tq + 4 * i) * RUN + 8 * c, g < group);
#pragma unroll
        for (int s = 0; s < KS; s++) {
            qa[s][0] = w[2 * s];
            qa[s][2] = w[2 * s + 1];
            qa[s][1] = qa[s][3] = 0u;
        }
    }
    const float scale_log2 = scale * 1.4426950408889634f;
    float o[NT][2];
#pragma unroll
    for (int j = 0; j < NT; j++) o[j][0] = o[j][1] = 0.f;
    float m = -NI_INF, l = 0.f;

    // Keys kb .. kb + KEYS - 1 (kb < end): scores, the online softmax (P
    // into s, O rescaled), then (accumulate) O += P V.
    auto score = [&](const unsigned (&kw)[2 * KB][KW], float (&s)[2 * KB][2], int kb) {
#pragma unroll
        for (int j = 0; j < 2 * KB; j++) {
            s[j][0] = s[j][1] = 0.f;
#pragma unroll
            for (int st = 0; st < KS; st++) {
                if constexpr (FP8)
                    mma16816_top(s[j], qa[st], e4m3_pair(kw[j][st], 0), e4m3_pair(kw[j][st], 1));
                else
                    mma16816_top(s[j], qa[st], kw[j][2 * st], kw[j][2 * st + 1]);
            }
        }
        if (kb + KEYS > end) {
#pragma unroll
            for (int j = 0; j < 2 * KB; j++)
#pragma unroll
                for (int e = 0; e < 2; e++)
                    if (kb + 8 * j + 2 * tq + e >= end) s[j][e] = -NI_INF;
        }
        // Key kb is unmasked, so the maximum is finite from the first step on.
        float mx = m;
#pragma unroll
        for (int j = 0; j < 2 * KB; j++) mx = fmaxf(mx, fmaxf(s[j][0], s[j][1]));
#pragma unroll
        for (int o_ = 1; o_ < 4; o_ <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o_));
        const float corr = exp2f((m - mx) * scale_log2), sub = mx * scale_log2;
        m = mx;
        l *= corr;
#pragma unroll
        for (int j = 0; j < 2 * KB; j++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                s[j][e] = exp2f(fmaf(s[j][e], scale_log2, -sub));
                l += s[j][e];
            }
        if (__any_sync(0xffffffffu, corr != 1.f)) {
#pragma unroll
            for (int j = 0; j < NT; j++) o[j][0] *= corr, o[j][1] *= corr;
        }
    };
    auto accumulate = [&](const unsigned (&vw)[4 * KB][VW], const float (&s)[2 * KB][2]) {
#pragma unroll
        for (int ks = 0; ks < KB; ks++) {
            const unsigned a[4] = {pack2(s[2 * ks][0], s[2 * ks][1]), 0u,
                                   pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]), 0u};
            const unsigned(&v)[4][VW] = *(const unsigned(*)[4][VW]) & vw[4 * ks];
#pragma unroll
            for (int j = 0; j < NT; j++) {
                unsigned b0, b1;
                if constexpr (FP8) {
                    b0 = e4m3_cross(v[0][j / 4], v[1][j / 4], j % 4);
                    b1 = e4m3_cross(v[2][j / 4], v[3][j / 4], j % 4);
                } else {
                    const int wi = 4 * (j / 8) + (j % 8) / 2;
                    const unsigned sel = (j & 1) ? 0x7632u : 0x5410u;
                    b0 = __byte_perm(v[0][wi], v[1][wi], sel);
                    b1 = __byte_perm(v[2][wi], v[3][wi], sel);
                }
                mma16816_top(o[j], a, b0, b1);
            }
        }
    };
    if constexpr (Ring::on) {
        unsigned next = slot_of(S);
        for (int t = 0; t < steps; t++) {
            // Groups committed: S + t; step t's is the (t + 1)-th, unless its
            // newest key joined the last prologue group.
            if (t == fixed_step)
                cp_async_wait_all();
            else
                cp_async_wait<S - 1>();
            __syncwarp();  // every lane's copies of step t have landed
            float s[2 * KB][2];
            fetch_keys(kw, t);
            score(kw, s, first_key + t * KEYS * DA_WARPS);
            fetch_values(vw, t);
            __syncwarp();  // and have been read before its slot is reused
            if (t + S < steps) issue(t + S, next, false, -1);
            cp_async_commit();
            next = slot_of(t + S + 1);
            accumulate(vw, s);
        }
        __syncthreads();  // the ring is free for the merge below (it aliases it)
    } else {
        for (; kb < end; kb += KEYS * DA_WARPS) {
            float s[2 * KB][2];
            score(kw, s, kb);
            accumulate(vw, s);
            if (kb + KEYS * DA_WARPS < end) load(kw, vw, kb + KEYS * DA_WARPS, end);
        }
    }
    // Each lane summed a quarter of its row's keys.
#pragma unroll
    for (int o_ = 1; o_ < 4; o_ <<= 1) l += __shfl_xor_sync(0xffffffffu, l, o_);
    if (tq == 0) {
        sm.m[warp][g] = m;
        sm.l[warp][g] = l;
    }
    // Merge the warps one head at a time; lanes of fragment row h hold it.
    for (int h = 0; h < group; h++) {
        __syncthreads();  // the previous head's sums are consumed (and m, l written)
        if (g == h) {
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int d = FP8 ? 2 * tq * (HD / 8) + j : 64 * (j / 8) + 16 * tq + j % 8;
                const int step = FP8 ? HD / 8 : 8;  // fragment column 2t + 1
                sm.o[warp][d] = o[j][0];
                sm.o[warp][d + step] = o[j][1];
            }
        }
        __syncthreads();
        store_merged_head<DA_WARPS>(
            &sm.m[0][h], &sm.l[0][h], DA_GROUP_MAX, sm.o[0], 128,
            [=](float d) { return exp2f(d * scale_log2); }, scale, HD,
            (size_t)row * heads + h0 + h, (size_t)prow * heads + h0 + h, split, splits, out, part_o,
            part_ml);
    }
}

// head_dim 64 or 128, at most DA_GROUP_MAX query heads per kv head (the host
// checks); attention_decode_mma_fp8 reads an FP8 cache.
template <typename KV>
__device__ void decode_mma_heads(const raw16* qkv, int stride, const KV* k_cache,
                                 const KV* v_cache, const unsigned* slot_list,
                                 const unsigned* table_off, const int* positions, int heads,
                                 int kv_heads, int hd, float scale, raw16* out, float* part_o,
                                 float* part_ml, const unsigned* row_list) {
    constexpr int ring_bytes = DecodeRing<KV>::bytes;
    static_assert(ring_bytes <= 48 * 1024, "the decode ring must fit static shared memory");
    __shared__ union {
        DecodeShared merge;
        uint4 ring[(ring_bytes > (int)sizeof(DecodeShared) ? ring_bytes : (int)sizeof(DecodeShared)) / 16];
    } shared;
    unsigned char* const smem = reinterpret_cast<unsigned char*>(&shared);
    grid_dep_launch();  // decode_mma waits once its first keys are requested
    if (hd == 128)
        decode_mma<128>(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, heads,
                        kv_heads, scale, out, part_o, part_ml, row_list, smem);
    else
        decode_mma<64>(qkv, stride, k_cache, v_cache, slot_list, table_off, positions, heads,
                       kv_heads, scale, out, part_o, part_ml, row_list, smem);
}
DECODE_ATTENTION_KERNEL(attention_decode_mma, raw16, DA_WARPS, DA_MIN_BLOCKS, decode_mma_heads)
DECODE_ATTENTION_KERNEL(attention_decode_mma_fp8, fp8, DA_WARPS, DA_FP8_MIN_BLOCKS, decode_mma_heads)
#undef DECODE_ATTENTION_KERNEL

#define ARGMAX_SPLITS 32  // blocks per row in argmax_partial; one warp merges them

// A slice's key when it holds a NaN or an infinity: above every real key
// (whose high word is at most the order key of +inf, 0xff800000), so it wins
// the merge and marks the whole row.
#define ARGMAX_NON_FINITE 0xffffffffffffffffull

// Greedy decoding on the GPU, step 1: the best (logit, index) key of slice
// blockIdx.y of the first `choosable` columns of row blockIdx.x (rows of
// `vocab`; the columns past the tokenizer are left out), or
// ARGMAX_NON_FINITE. grid = (rows, ARGMAX_SPLITS), block = 256.
extern "C" __global__ void argmax_partial(const float* logits, int vocab, int choosable,
                                          unsigned long long* part) {
    GRID_DEP_ENTER();
    __shared__ unsigned long long best_w[32];
    const int chunk = (choosable + ARGMAX_SPLITS - 1) / ARGMAX_SPLITS;
    const int begin = blockIdx.y * chunk, end = min(choosable, begin + chunk);
    const float* row = logits + (size_t)blockIdx.x * vocab;
    unsigned long long best = 0;
    int non_finite = 0;
    for (int i = begin + threadIdx.x; i < end; i += blockDim.x) {
        const float x = row[i];
        non_finite |= !isfinite(x);
        const unsigned long long key = argmax_key(x, i);
        best = key > best ? key : best;
    }
    if (__syncthreads_or(non_finite)) best = ARGMAX_NON_FINITE;
    best = warp_max_u64(best);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) best_w[warp] = best;
    __syncthreads();
    if (warp == 0) {
        best = warp_max_u64(lane < (int)(blockDim.x >> 5) ? best_w[lane] : 0ull);
        if (lane == 0) part[(size_t)blockIdx.x * ARGMAX_SPLITS + blockIdx.y] = best;
    }
}

// Step 2: ids[r] = index of the first largest logit of row r, or
// 0xffffffff (the engine's NON_FINITE_ROW) when the row holds a NaN or an
// infinity, as the CPU reports it. grid = rows, block = 32.
extern "C" __global__ void argmax_merge(const unsigned long long* part, unsigned* ids) {
    GRID_DEP_ENTER();
    const unsigned long long best =
        warp_max_u64(part[(size_t)blockIdx.x * ARGMAX_SPLITS + threadIdx.x]);
    if (threadIdx.x == 0)
        ids[blockIdx.x] = best == ARGMAX_NON_FINITE ? 0xffffffffu
                                                    : 0xffffffffu - (unsigned)(best & 0xffffffffu);
}
