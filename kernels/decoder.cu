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

// Sum over the block (blockDim.x a multiple of 32); every thread gets it.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.f;
    return warp_sum(v);
}

// out[r] = table[tokens[r]]; grid = rows.
extern "C" __global__ void embed(const raw16* table, const unsigned* tokens, raw16* out, int d) {
    const raw16* src = table + (size_t)tokens[blockIdx.x] * d;
    raw16* dst = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) dst[i] = src[i];
}

// Output row j reads input row r = rows ? rows[j] : j. With `delta`, the
// residual row becomes residual + delta (written back when `rows` is null).
// out[j] = rmsnorm(residual[r]) * w. grid = output rows.
extern "C" __global__ void add_rms_norm(raw16* residual, const raw16* delta, const unsigned* rows,
                                        const raw16* w, raw16* out, int d, float eps) {
    const size_t r = rows ? rows[blockIdx.x] : blockIdx.x;
    raw16* x = residual + r * d;
    const raw16* dx = delta ? delta + r * d : 0;
    const bool write_back = delta && !rows;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(x[i]);
        if (dx) {
            v = rnd(v + to_f(dx[i]));
            if (write_back) x[i] = from_f(v);
        }
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss) / d + eps);
    raw16* y = out + (size_t)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float v = to_f(x[i]);
        if (dx && !write_back) v = rnd(v + to_f(dx[i]));
        y[i] = from_f(to_f(w[i]) * rnd(v * rstd));
    }
}

// Per-head RMSNorm (Qwen3 q_norm / k_norm) in place on heads starting at
// column `offset` of rows of stride `stride`. grid = (rows, heads), block = 32.
extern "C" __global__ void head_rms_norm(raw16* x, const raw16* w, int stride, int offset, int hd,
                                         float eps) {
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
    raw16* row = x + (size_t)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) row[i] = from_f(to_f(row[i]) + to_f(b[i]));
}

// Rotary embedding (rotate-half form) in place on the q and k heads of the
// fused QKV rows; angle = position * inv_freq[i]. grid = rows.
extern "C" __global__ void rope(raw16* qkv, const int* positions, const float* inv_freq, int stride,
                                int heads, int hd) {
    const int half = hd / 2;
    const float pos = (float)positions[blockIdx.x];
    raw16* row = qkv + (size_t)blockIdx.x * stride;
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        const int h = t / half, i = t % half;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        c = rnd(c);
        s = rnd(s);
        raw16* p = row + h * hd;
        const float x1 = to_f(p[i]), x2 = to_f(p[i + half]);
        p[i] = from_f(rnd(x1 * c) - rnd(x2 * s));
        p[i + half] = from_f(rnd(x2 * c) + rnd(x1 * s));
    }
}

// out[r, i] = silu(gate[r, i]) * up[r, i] over rows of [gate | up]. grid = rows.
extern "C" __global__ void silu_mul(const raw16* gate_up, raw16* out, int inter) {
    const raw16* g = gate_up + (size_t)blockIdx.x * 2 * inter;
    raw16* y = out + (size_t)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float a = to_f(g[i]);
        y[i] = from_f(rnd(a / (1.f + __expf(-a))) * to_f(g[inter + i]));
    }
}

// Copies each row's k and v (columns k_off.. and v_off.. of the QKV row) to
// its slot of the layer's cache. grid = rows.
extern "C" __global__ void kv_write(const raw16* qkv, int stride, int k_off, int v_off,
                                    const unsigned* slots, raw16* k_cache, raw16* v_cache,
                                    int kv_width) {
    const raw16* row = qkv + (size_t)blockIdx.x * stride;
    const size_t dst = (size_t)slots[blockIdx.x] * kv_width;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        k_cache[dst + i] = row[k_off + i];
        v_cache[dst + i] = row[v_off + i];
    }
}

#define ATTN_WARPS 8
#define MAX_PER_LANE 8  // head_dim <= 256

// Causal attention of one (head, row, split): the row attends to positions
// [split * chunk, min((split + 1) * chunk, pos + 1)) of its sequence, whose
// slots are slot_list[table_off[row] + p]. Each warp walks every
// ATTN_WARPS-th position with an online softmax (no shared-memory bound on
// the context length); the warps then merge. With one split the result goes
// to `out` ([rows, heads * hd]); otherwise the unnormalized partial sum and
// its (max, sum) go to part_o / part_ml for attn_merge.
// grid = (heads, rows, splits), block = 32 * ATTN_WARPS.
extern "C" __global__ void attention(const raw16* qkv, int stride, const raw16* k_cache,
                                     const raw16* v_cache, const unsigned* slot_list,
                                     const unsigned* table_off, const int* positions, int heads,
                                     int kv_heads, int hd, float scale, raw16* out, float* part_o,
                                     float* part_ml) {
    const int head = blockIdx.x, row = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int per_lane = hd >> 5;
    const int kv_head = head / (heads / kv_heads);
    const int kv_width = kv_heads * hd;
    const int n = positions[row] + 1;
    const int chunk = (n + splits - 1) / splits;
    const int begin = split * chunk;
    const int end = min(n, begin + chunk);
    const unsigned* slots = slot_list + table_off[row];

    float q[MAX_PER_LANE], acc[MAX_PER_LANE];
    const raw16* qh = qkv + (size_t)row * stride + head * hd;
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; e++) {
        q[e] = e < per_lane ? to_f(qh[lane + 32 * e]) * scale : 0.f;
        acc[e] = 0.f;
    }
    float m = -NI_INF, l = 0.f;
    // Two positions per iteration: their loads overlap, halving the chain
    // of dependent global-memory round trips each warp walks.
    for (int p = begin + warp; p < end; p += 2 * ATTN_WARPS) {
        const int p2 = p + ATTN_WARPS;
        const bool two = p2 < end;
        const size_t b1 = (size_t)slots[p] * kv_width + kv_head * hd;
        const size_t b2 = two ? (size_t)slots[p2] * kv_width + kv_head * hd : b1;
        float s1 = 0.f, s2 = 0.f;
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; e++)
            if (e < per_lane) {
                s1 += q[e] * to_f(k_cache[b1 + lane + 32 * e]);
                s2 += q[e] * to_f(k_cache[b2 + lane + 32 * e]);
            }
        s1 = warp_sum(s1);
        s2 = two ? warp_sum(s2) : -NI_INF;
        const float m_new = fmaxf(m, fmaxf(s1, s2));
        const float corr = __expf(m - m_new);
        const float w1 = __expf(s1 - m_new);
        const float w2 = two ? __expf(s2 - m_new) : 0.f;
        l = l * corr + w1 + w2;
#pragma unroll
        for (int e = 0; e < MAX_PER_LANE; e++)
            if (e < per_lane)
                acc[e] = acc[e] * corr + w1 * to_f(v_cache[b1 + lane + 32 * e]) +
                         w2 * to_f(v_cache[b2 + lane + 32 * e]);
        m = m_new;
    }

    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    __shared__ float sm_acc[ATTN_WARPS][32 * MAX_PER_LANE];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
#pragma unroll
    for (int e = 0; e < MAX_PER_LANE; e++)
        if (e < per_lane) sm_acc[warp][lane + 32 * e] = acc[e];
    __syncthreads();
    float big = -NI_INF;
    for (int w = 0; w < ATTN_WARPS; w++) big = fmaxf(big, sm_m[w]);
    float total = 0.f, f[ATTN_WARPS];
    for (int w = 0; w < ATTN_WARPS; w++) {
        f[w] = sm_l[w] > 0.f ? __expf(sm_m[w] - big) : 0.f;
        total += sm_l[w] * f[w];
    }
    const size_t rh = (size_t)row * heads + head;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < ATTN_WARPS; w++) o += sm_acc[w][i] * f[w];
        if (splits == 1)
            out[rh * hd + i] = from_f(total > 0.f ? o / total : 0.f);
        else
            part_o[(rh * splits + split) * hd + i] = o;
    }
    if (splits > 1 && threadIdx.x == 0) {
        part_ml[(rh * splits + split) * 2] = total > 0.f ? big : -NI_INF;
        part_ml[(rh * splits + split) * 2 + 1] = total;
    }
}

// Merges the splits of attention: grid = (heads, rows), block >= hd threads.
extern "C" __global__ void attn_merge(const float* part_o, const float* part_ml, int heads, int hd,
                                      int splits, raw16* out) {
    const size_t rh = (size_t)blockIdx.y * heads + blockIdx.x;
    const float* ml = part_ml + rh * splits * 2;
    float big = -NI_INF;
    for (int s = 0; s < splits; s++) big = fmaxf(big, ml[2 * s]);
    float total = 0.f;
    for (int s = 0; s < splits; s++)
        if (ml[2 * s + 1] > 0.f) total += ml[2 * s + 1] * __expf(ml[2 * s] - big);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.f;
        for (int s = 0; s < splits; s++)
            if (ml[2 * s + 1] > 0.f) o += part_o[(rh * splits + s) * hd + i] * __expf(ml[2 * s] - big);
        out[rh * hd + i] = from_f(total > 0.f ? o / total : 0.f);
    }
}

// Gathers (to_host = 1) or scatters (0) whole KV slots of one layer between
// the cache and a staging buffer [n, kv_width]: swap-out and swap-in.
extern "C" __global__ void kv_copy_slots(raw16* k_cache, raw16* v_cache, const unsigned* slots,
                                         raw16* staging, int kv_width, int to_host) {
    const size_t src = (size_t)slots[blockIdx.x] * kv_width;
    raw16* k = staging + (size_t)blockIdx.x * 2 * kv_width;
    raw16* v = k + kv_width;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
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

// Eight 16-bit values of a 16-byte load, as floats.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    const unsigned u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        f[2 * i] = to_f((raw16)(u[i] & 0xffffu));
        f[2 * i + 1] = to_f((raw16)(u[i] >> 16));
    }
}

template <int R>
__device__ void gemv_rows(const raw16* x, const raw16* w, void* y, int n, int k, int f32_out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + warp;
    if (j >= n) return;
    const uint4* wr = (const uint4*)(w + (size_t)j * k);
    const int chunks = k >> 3;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
#pragma unroll 4
    for (int c = lane; c < chunks; c += 32) {
        float wf[8], xf[8];
        unpack8(__ldg(wr + c), wf);
#pragma unroll
        for (int r = 0; r < R; r++) {
            unpack8(__ldg((const uint4*)(x + (size_t)r * k) + c), xf);
#pragma unroll
            for (int i = 0; i < 8; i++) acc[r] += wf[i] * xf[i];
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const float v = warp_sum(acc[r]);
        if (lane == 0) {
            if (f32_out)
                ((float*)y)[(size_t)r * n + j] = v;
            else
                ((raw16*)y)[(size_t)r * n + j] = from_f(v);
        }
    }
}

// y[r, j] = sum_k x[r, k] * w[j, k] for rows r < R <= GEMV_MAX_ROWS (decode
// batches): each warp streams one weight row once with 16-byte loads, the
// few activation rows come from cache. k must be a multiple of 8.
// grid = ceil(n / GEMV_WARPS), block = 32 * GEMV_WARPS.
extern "C" __global__ void gemv(const raw16* x, const raw16* w, void* y, int n, int k, int rows,
                                int f32_out) {
    switch (rows) {
    case 1: gemv_rows<1>(x, w, y, n, k, f32_out); break;
    case 2: gemv_rows<2>(x, w, y, n, k, f32_out); break;
    case 3: gemv_rows<3>(x, w, y, n, k, f32_out); break;
    case 4: gemv_rows<4>(x, w, y, n, k, f32_out); break;
    case 5: gemv_rows<5>(x, w, y, n, k, f32_out); break;
    case 6: gemv_rows<6>(x, w, y, n, k, f32_out); break;
    case 7: gemv_rows<7>(x, w, y, n, k, f32_out); break;
    case 8: gemv_rows<8>(x, w, y, n, k, f32_out); break;
    }
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
// block = 32 * TILE_WARPS.
extern "C" __global__ void attention_tiles(const raw16* qkv, int stride, const raw16* k_cache,
                                           const raw16* v_cache, const unsigned* slot_list,
                                           const unsigned* table_off, const int* positions,
                                           const unsigned* tile_row, const unsigned* tile_n,
                                           int heads, int kv_heads, int hd, float scale,
                                           raw16* out) {
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
                kv = k_cache[base];
                vv = v_cache[base];
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

// ids[r] = index of the first largest logit of row r (greedy decoding on the
// GPU: only the ids travel to the host). grid = rows, block = 1024.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, unsigned* ids) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float v = -NI_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = row[i];
        if (x > v) {  // strided ascending scan: the first max of this thread
            v = x;
            idx = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        v = lane < nw ? best_v[lane] : -NI_INF;
        idx = lane < nw ? best_i[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) {
                v = ov;
                idx = oi;
            }
        }
        if (lane == 0) ids[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
    }
}
