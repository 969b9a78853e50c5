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
#include "cuda_green.cuh"

struct Work {
    int m, n, k;
    void *a, *b, *c;  // bf16 [m, k], [n, k], [m, n]
    const uint4* buf;
    size_t words;  // 16-byte words streamed
    size_t mask;   // cover_mask(words): each word read once
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

static void stream(const Lane& l, const Work& w) { stream_on(l, w.buf, w.mask, w.words, w.sink); }

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
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(nullptr));  // the primary context
    CUcontext primary;
    CU(cuCtxGetCurrent(&primary));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    Work w{m, n, k};
    CHECK(cudaMalloc(&w.a, (size_t)m * k * 2));
    CHECK(cudaMalloc(&w.b, (size_t)n * k * 2));
    CHECK(cudaMalloc(&w.c, (size_t)m * n * 2));
    CHECK(cudaMemset(w.a, 0x3c, (size_t)m * k * 2));
    CHECK(cudaMemset(w.b, 0x3c, (size_t)n * k * 2));
    w.words = (size_t)(mb * 1e6 / 16);
    w.mask = cover_mask(w.words);
    void* buf;
    CHECK(cudaMalloc(&buf, w.words * 16));
    CHECK(cudaMemset(buf, 1, w.words * 16));
    w.buf = (const uint4*)buf;
    CHECK(cudaMalloc(&w.sink, 4));
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

    for (int want : {16, 24, 32, 48, 64}) {
        GreenSplit split = green_split(dev, want);
        const Lane &r = split.part, &g = split.rest;
        const double tg1 = time_us([&] { gemm(g, w); }, &g, nullptr);
        const double tr1 = time_us([&] { stream(r, w); }, &r, nullptr);
        const double pair = time_us([&] { gemm(g, w), stream(r, w); }, &g, &r);
        char label[64];
        snprintf(label, sizeof label, "green: stream %d SMs, GEMM %d", r.sms, g.sms);
        printf("%-34s %10.1f %10.1f %12.1f %10.2f   (%.0f TFLOP/s, %.2f TB/s alone)\n", label, tg1,
               tr1, pair, (tg + tr) / pair, flops / tg1 / 1e6, bytes / tr1 / 1e6);
        destroy(split, primary);
    }
    return 0;
}
