// Batch-1 decode GEMV with FP8 (E4M3) weights against bf16 weights on this
// GPU, for issue 45's "FP8 batch-1 decode >= 1.8x own bf16": the same simple
// kernel shape for both (one warp per output row, two 16-byte weight loads
// in flight per thread, bf16 activations read through L1, f32 sums, a
// per-row f32 scale for FP8), over the Llama-3-8B projection shapes and LM
// head. Each shape cycles through enough distinct weight copies (>= 400 MB)
// that L2 holds none of them between launches, as in a real model.
// Printed per shape: time and weight bandwidth for both; then the GEMV-only
// decode rate of the 8B shape (32 layers of the four projections + LM head)
// and its ratio, against the device-to-device copy bandwidth.
// The FP8 result is checked against a host reference on the first shape.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90 -o /tmp/fp8gemv scripts/cuda_fp8_gemv_bench.cu && /tmp/fp8gemv
#include <algorithm>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>
#include "cuda_check.cuh"

struct Shape { const char* name; int n, k, per_token; };
constexpr Shape SHAPES[] = {
    {"qkv", 6144, 4096, 32}, {"o", 4096, 4096, 32}, {"gate_up", 28672, 4096, 32},
    {"down", 4096, 14336, 32}, {"lm_head", 128256, 4096, 1},
};

__device__ __forceinline__ float dot8_bf16(uint4 w, const uint4 x) {
    const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
        s = fmaf(fa.x, fb.x, s);
        s = fmaf(fa.y, fb.y, s);
    }
    return s;
}

// 16 E4M3 weights against 16 bf16 activations (two uint4).
__device__ __forceinline__ float dot16_fp8(uint4 w, uint4 xa, uint4 xb) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    const __nv_bfloat162* x0 = reinterpret_cast<const __nv_bfloat162*>(&xa);
    const __nv_bfloat162* x1 = reinterpret_cast<const __nv_bfloat162*>(&xb);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        __nv_fp8x4_e4m3 q;
        q.__x = words[i];
        float4 f = static_cast<float4>(q);
        const __nv_bfloat162* xp = i < 2 ? x0 + 2 * i : x1 + 2 * (i - 2);
        float2 a = __bfloat1622float2(xp[0]), b = __bfloat1622float2(xp[1]);
        s = fmaf(f.x, a.x, s);
        s = fmaf(f.y, a.y, s);
        s = fmaf(f.z, b.x, s);
        s = fmaf(f.w, b.y, s);
    }
    return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void gemv_bf16(const __nv_bfloat16* __restrict__ w, const __nv_bfloat16* __restrict__ x,
                          __nv_bfloat16* __restrict__ y, int n, int k) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    int vecs = k / 8;
    float acc = 0.f;
    int i = lane;
    for (; i + 32 < vecs; i += 64) {
        uint4 a = __ldcs(wr + i), b = __ldcs(wr + i + 32);
        acc += dot8_bf16(a, __ldg(xv + i)) + dot8_bf16(b, __ldg(xv + i + 32));
    }
    for (; i < vecs; i += 32) acc += dot8_bf16(__ldcs(wr + i), __ldg(xv + i));
    acc = warp_sum(acc);
    if (lane == 0) y[row] = __float2bfloat16(acc);
}

// U weight loads of 16 bytes in flight per thread.
template <int U>
__global__ void gemv_fp8(const uint8_t* __restrict__ w, const float* __restrict__ scale,
                         const __nv_bfloat16* __restrict__ x, __nv_bfloat16* __restrict__ y, int n, int k) {
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (row >= n) return;
    const uint4* wr = reinterpret_cast<const uint4*>(w + (size_t)row * k);
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    int vecs = k / 16;
    float acc = 0.f;
    int i = lane;
    for (; i + 32 * (U - 1) < vecs; i += 32 * U) {
        uint4 q[U];
#pragma unroll
        for (int u = 0; u < U; u++) q[u] = __ldcs(wr + i + 32 * u);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int j = i + 32 * u;
            acc += dot16_fp8(q[u], __ldg(xv + 2 * j), __ldg(xv + 2 * j + 1));
        }
    }
    for (; i < vecs; i += 32) acc += dot16_fp8(__ldcs(wr + i), __ldg(xv + 2 * i), __ldg(xv + 2 * i + 1));
    acc = warp_sum(acc);
    if (lane == 0) y[row] = __float2bfloat16(acc * scale[row]);
}

__global__ void fill_bytes(uint8_t* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        uint8_t b = h & 0xff;
        p[i] = (b & 0x7f) == 0x7f ? 0 : b;  // no NaN codes
    }
}

int main() {
    constexpr size_t POOL = 400u << 20;
    constexpr int THREADS = 256, WARMUP = 10, ITERS = 100;
    int max_k = 14336, max_n = 128256;
    __nv_bfloat16 *x, *y;
    float* scale;
    CHECK(cudaMalloc(&x, max_k * 2));
    CHECK(cudaMalloc(&y, max_n * 2));
    CHECK(cudaMalloc(&scale, max_n * 4));
    std::vector<__nv_bfloat16> hx(max_k);
    std::vector<float> hs(max_n);
    for (int i = 0; i < max_k; i++) hx[i] = __float2bfloat16(std::sin(0.37f * i));
    for (int i = 0; i < max_n; i++) hs[i] = 0.001f * (1 + i % 7);
    CHECK(cudaMemcpy(x, hx.data(), max_k * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(scale, hs.data(), max_n * 4, cudaMemcpyHostToDevice));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));

    // Device-to-device copy bandwidth (read + write), 1 GiB.
    uint8_t *ca, *cb;
    size_t cbytes = 1u << 30;
    CHECK(cudaMalloc(&ca, cbytes));
    CHECK(cudaMalloc(&cb, cbytes));
    for (int i = 0; i < 3; i++) CHECK(cudaMemcpy(cb, ca, cbytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(t0));
    for (int i = 0; i < 10; i++) CHECK(cudaMemcpy(cb, ca, cbytes, cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(t1));
    CHECK(cudaEventSynchronize(t1));
    float cms;
    CHECK(cudaEventElapsedTime(&cms, t0, t1));
    double copy_bw = 2.0 * cbytes * 10 / (cms / 1e3) / 1e9;
    CHECK(cudaFree(ca));
    CHECK(cudaFree(cb));
    printf("device copy bandwidth (read + write): %.0f GB/s\n", copy_bw);

    double token_bf16 = 0, token_fp8 = 0, bytes_bf16 = 0, bytes_fp8 = 0;
    printf("%-8s %7s %6s | %9s %8s | %9s %8s | %5s\n", "shape", "n", "k", "bf16 us", "GB/s", "fp8 us", "GB/s", "ratio");

    for (const Shape& s : SHAPES) {
        size_t elems = (size_t)s.n * s.k;
        double us[3];
        for (int fmt = 0; fmt < 3; fmt++) {
            size_t bytes = elems * (fmt == 0 ? 2 : 1);
            int copies = (int)std::max<size_t>(1, (POOL + bytes - 1) / bytes);
            uint8_t* pool;
            CHECK(cudaMalloc(&pool, bytes * copies));
            // Random bits: speed does not depend on the values (bf16 NaNs included).
            fill_bytes<<<1024, 256>>>(pool, bytes * copies, 7u + fmt);
            CHECK(cudaGetLastError());
            int blocks = (s.n * 32 + THREADS - 1) / THREADS;
            auto launch = [&](int it) {
                uint8_t* w = pool + (size_t)(it % copies) * bytes;
                if (fmt == 0)
                    gemv_bf16<<<blocks, THREADS>>>((const __nv_bfloat16*)w, x, y, s.n, s.k);
                else if (fmt == 1)
                    gemv_fp8<2><<<blocks, THREADS>>>(w, scale, x, y, s.n, s.k);
                else
                    gemv_fp8<4><<<blocks, THREADS>>>(w, scale, x, y, s.n, s.k);
            };
            for (int i = 0; i < WARMUP; i++) launch(i);
            CHECK(cudaEventRecord(t0));
            for (int i = 0; i < ITERS; i++) launch(i);
            CHECK(cudaEventRecord(t1));
            CHECK(cudaEventSynchronize(t1));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            us[fmt] = ms * 1e3 / ITERS;
            if (fmt >= 1 && &s == &SHAPES[0]) {
                // Host reference for copy 0 of the first shape.
                launch(0);
                CHECK(cudaDeviceSynchronize());
                std::vector<uint8_t> hw(elems);
                std::vector<__nv_bfloat16> hy(s.n);
                CHECK(cudaMemcpy(hw.data(), pool, elems, cudaMemcpyDeviceToHost));
                CHECK(cudaMemcpy(hy.data(), y, s.n * 2, cudaMemcpyDeviceToHost));
                double worst = 0;
                for (int r = 0; r < s.n; r++) {
                    double ref = 0, mag = 0;
                    for (int c = 0; c < s.k; c++) {
                        __nv_fp8_e4m3 q;
                        q.__x = hw[(size_t)r * s.k + c];
                        double v = (double)(float)q * __bfloat162float(hx[c]);
                        ref += v, mag += std::fabs(v);
                    }
                    ref *= hs[r], mag *= hs[r];
                    worst = std::max(worst, std::fabs(__bfloat162float(hy[r]) - ref) / (mag + 1e-30));
                }
                printf("fp8 GEMV x%d vs host reference (%s): worst |error| / sum|terms| = %.2e %s\n", fmt == 1 ? 2 : 4, s.name, worst,
                       worst < 1e-2 ? "ok" : "WRONG");

            }
            CHECK(cudaFree(pool));
        }
        // The faster FP8 variant (2 or 4 loads in flight) per shape.
        int best = us[1] <= us[2] ? 1 : 2;
        double gb16 = elems * 2.0 / (us[0] * 1e3), gb8 = elems * 1.0 / (us[best] * 1e3);
        printf("%-8s %7d %6d | %9.1f %8.0f | %9.1f %8.0f | %5.2f  (fp8 x2 %.1f us, x4 %.1f us)\n", s.name, s.n, s.k,
               us[0], gb16, us[best], gb8, us[0] / us[best], us[1], us[2]);
        token_bf16 += us[0] * s.per_token, token_fp8 += us[best] * s.per_token;
        bytes_bf16 += elems * 2.0 * s.per_token, bytes_fp8 += elems * 1.0 * s.per_token;
    }
    printf("8B decode, GEMVs only: bf16 %.1f tok/s (%.1f GB/token, %.0f%% of copy bw), fp8 %.1f tok/s (%.1f GB/token, %.0f%%): %.2fx\n",
           1e6 / token_bf16, bytes_bf16 / 1e9, 100 * bytes_bf16 / (token_bf16 * 1e3) / copy_bw,
           1e6 / token_fp8, bytes_fp8 / 1e9, 100 * bytes_fp8 / (token_fp8 * 1e3) / copy_bw, token_bf16 / token_fp8);
    return 0;
}
