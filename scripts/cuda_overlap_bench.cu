// Can decode attention run *under* the GEMMs of a decode step? The question
// behind NanoFlow-style nano-batches for issue 9's offline target
// (BENCHMARKS.md session 19). A decode step of ~1 000 rows is a set of GEMMs
// near the tensor-core peak plus decode attention near the memory's limit;
// run one after the other they add up. This measures, for one GEMM shape of
// that step (bf16 cuBLAS, M x N x K = rows x out x in) and a memory-bound
// kernel streaming as many bytes as the step's attention per layer (16-byte
// loads that skip L1, 4 blocks of 256 threads per SM, eight loads in flight
// per thread):
//   - each alone on the whole GPU, then one after the other;
//   - both at once on two plain streams (the block scheduler shares SMs as
//     they free up);
//   - both at once on two green contexts (CUDA 12.4+): the streaming kernel
//     on R SMs, the GEMM on the rest, for several R; and each alone on its
//     partition.
// Time per pair is the mean over a loop that keeps both streams busy.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/overlap scripts/cuda_overlap_bench.cu -lcuda -lcublas && /tmp/overlap
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>

#define CU(x)                                                                  \
    do {                                                                       \
        CUresult err_ = (x);                                                      \
        if (err_ != CUDA_SUCCESS) {                                               \
            const char* s = "?";                                               \
            cuGetErrorString(err_, &s);                                           \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s);      \
            exit(1);                                                           \
        }                                                                      \
    } while (0)
#define RT(x)                                                                  \
    do {                                                                       \
        cudaError_t err_ = (x);                                                   \
        if (err_ != cudaSuccess) {                                                \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)
#define BL(x)                                                                  \
    do {                                                                       \
        cublasStatus_t err_ = (x);                                                \
        if (err_ != CUBLAS_STATUS_SUCCESS) {                                      \
            fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)err_); \
            exit(1);                                                           \
        }                                                                      \
    } while (0)

// Each thread keeps UNROLL 16-byte loads in flight (a warp 4 KB, like a
// decode attention warp with its ring): with one at a time an SM pulls only
// ~40 GB/s, and a partition of a few SMs could not show what it can do.
constexpr int UNROLL = 8;
__global__ void stream_read(const uint4* p, size_t n, unsigned* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += UNROLL * stride) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++)
            v[u] = i + u * stride < n ? __ldcg(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < UNROLL; u++) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// One place work runs: a context (primary or green), its stream, a cuBLAS
// handle bound to that stream, and how many SMs it has.
struct Lane {
    CUcontext ctx;
    CUstream stream;
    cublasHandle_t blas;
    int sms;
};

static Lane make_lane(CUcontext ctx, CUstream stream, int sms) {
    Lane l{ctx, stream, nullptr, sms};
    CU(cuCtxSetCurrent(ctx));
    BL(cublasCreate(&l.blas));
    BL(cublasSetStream(l.blas, (cudaStream_t)stream));
    return l;
}

struct Work {
    int m, n, k;
    void *a, *b, *c;  // bf16 [m, k], [n, k], [m, n]
    const uint4* buf;
    size_t words;  // 16-byte words streamed
    unsigned* sink;
};

static void gemm(const Lane& l, const Work& w) {
    const float one = 1.f, zero = 0.f;
    CU(cuCtxSetCurrent(l.ctx));
    // Row-major C = A Bᵀ is column-major Cᵀ = B Aᵀ.
    BL(cublasGemmEx(l.blas, CUBLAS_OP_T, CUBLAS_OP_N, w.n, w.m, w.k, &one, w.b, CUDA_R_16BF, w.k,
                    w.a, CUDA_R_16BF, w.k, &zero, w.c, CUDA_R_16BF, w.n, CUBLAS_COMPUTE_32F,
                    CUBLAS_GEMM_DEFAULT));
}

static void stream(const Lane& l, const Work& w) {
    CU(cuCtxSetCurrent(l.ctx));
    stream_read<<<l.sms * 4, 256, 0, (cudaStream_t)l.stream>>>(w.buf, w.words, w.sink);
    RT(cudaGetLastError());
}

// Mean µs per iteration of `body`, after two warm-up iterations.
template <typename F>
static double time_us(F body, const Lane* a, const Lane* b, int iters = 40) {
    auto sync = [&] {
        if (a) CU(cuStreamSynchronize(a->stream));
        if (b) CU(cuStreamSynchronize(b->stream));
    };
    for (int i = 0; i < 2; i++) body();
    sync();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; i++) body();
    sync();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
}

int main(int argc, char** argv) {
    const int m = argc > 1 ? atoi(argv[1]) : 1024, n = argc > 2 ? atoi(argv[2]) : 28672,
              k = argc > 3 ? atoi(argv[3]) : 4096;
    const double mb = argc > 4 ? atof(argv[4]) : 1024.0;  // MB streamed per pair
    CU(cuInit(0));
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    RT(cudaSetDevice(0));
    RT(cudaFree(nullptr));  // the primary context
    CUcontext primary;
    CU(cuCtxGetCurrent(&primary));
    int sms = 0;
    RT(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    Work w{m, n, k};
    RT(cudaMalloc(&w.a, (size_t)m * k * 2));
    RT(cudaMalloc(&w.b, (size_t)n * k * 2));
    RT(cudaMalloc(&w.c, (size_t)m * n * 2));
    RT(cudaMemset(w.a, 0x3c, (size_t)m * k * 2));
    RT(cudaMemset(w.b, 0x3c, (size_t)n * k * 2));
    w.words = (size_t)(mb * 1e6 / 16);
    void* buf;
    RT(cudaMalloc(&buf, w.words * 16));
    RT(cudaMemset(buf, 1, w.words * 16));
    w.buf = (const uint4*)buf;
    RT(cudaMalloc(&w.sink, 4));
    const double flops = 2.0 * m * n * k, bytes = w.words * 16.0;

    CUstream s1, s2;
    CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    const Lane g_full = make_lane(primary, s1, sms), r_full = make_lane(primary, s2, sms);
    const double tg = time_us([&] { gemm(g_full, w); }, &g_full, nullptr);
    const double tr = time_us([&] { stream(r_full, w); }, &r_full, nullptr);
    const double both = time_us([&] { gemm(g_full, w), stream(r_full, w); }, &g_full, &r_full);
    printf("GEMM %dx%dx%d (bf16, %.0f GFLOP), streaming %.0f MB; %d SMs\n", m, n, k, flops / 1e9,
           bytes / 1e6, sms);
    printf("%-34s %10s %10s %12s %10s\n", "", "GEMM us", "stream us", "pair us", "vs serial");
    printf("%-34s %10.1f %10.1f %12.1f %10.2f   (%.0f TFLOP/s, %.2f TB/s alone)\n",
           "whole GPU, one after the other", tg, tr, tg + tr, 1.0, flops / tg / 1e6,
           bytes / tr / 1e6);
    printf("%-34s %10s %10s %12.1f %10.2f\n", "whole GPU, two streams at once", "", "", both,
           (tg + tr) / both);

    CUdevResource all;
    CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    for (int want : {16, 24, 32, 48, 64}) {
        CUdevResource part, rest;
        unsigned groups = 1;
        CU(cuDevSmResourceSplitByCount(&part, &groups, &all, &rest, 0, want));
        CUdevResourceDesc dpart, drest;
        CU(cuDevResourceGenerateDesc(&dpart, &part, 1));
        CU(cuDevResourceGenerateDesc(&drest, &rest, 1));
        CUgreenCtx gpart, grest;
        CU(cuGreenCtxCreate(&gpart, dpart, dev, CU_GREEN_CTX_DEFAULT_STREAM));
        CU(cuGreenCtxCreate(&grest, drest, dev, CU_GREEN_CTX_DEFAULT_STREAM));
        CUcontext cpart, crest;
        CU(cuCtxFromGreenCtx(&cpart, gpart));
        CU(cuCtxFromGreenCtx(&crest, grest));
        CUstream spart, srest;
        CU(cuGreenCtxStreamCreate(&spart, gpart, CU_STREAM_NON_BLOCKING, 0));
        CU(cuGreenCtxStreamCreate(&srest, grest, CU_STREAM_NON_BLOCKING, 0));
        const Lane r = make_lane(cpart, spart, part.sm.smCount),
                   g = make_lane(crest, srest, rest.sm.smCount);
        const double tg1 = time_us([&] { gemm(g, w); }, &g, nullptr);
        const double tr1 = time_us([&] { stream(r, w); }, &r, nullptr);
        const double pair = time_us([&] { gemm(g, w), stream(r, w); }, &g, &r);
        char label[64];
        snprintf(label, sizeof label, "green: stream %d SMs, GEMM %d", r.sms, g.sms);
        printf("%-34s %10.1f %10.1f %12.1f %10.2f   (%.0f TFLOP/s, %.2f TB/s alone)\n", label, tg1,
               tr1, pair, (tg + tr) / pair, flops / tg1 / 1e6, bytes / tr1 / 1e6);
        CU(cuCtxSetCurrent(primary));
        BL(cublasDestroy(r.blas));
        BL(cublasDestroy(g.blas));
        CU(cuStreamDestroy(spart));
        CU(cuStreamDestroy(srest));
        CU(cuGreenCtxDestroy(gpart));
        CU(cuGreenCtxDestroy(grest));
    }
    return 0;
}
