// What a benchmark that runs memory-bound work beside cuBLAS GEMMs needs
// (cuda_offline_bound_bench.cu; cuda_overlap_bench.cu used it too, see
// docs/rejected-ideas.md): a kernel streaming
// bytes the way decode attention reads its KV cache, "lanes" (a context, a
// stream and a cuBLAS handle on it) and green contexts that split the SMs
// between two lanes (CUDA 12.4+).
#pragma once
#include "cuda_check.cuh"

// Each thread keeps STREAM_UNROLL 16-byte loads in flight (a warp 4 KB, like
// a decode attention warp with its ring): with one at a time an SM pulls
// only ~40 GB/s, and a partition of a few SMs could not show what it can do.
constexpr int STREAM_UNROLL = 8;

// Reads `words` 16-byte words of `p`, going round a buffer of mask + 1 words
// (a power of two; pass one at least `words` to read each word once).
__global__ void stream_read(const uint4* p, size_t mask, size_t words, unsigned* sink) {
    uint4 acc = make_uint4(0, 0, 0, 0);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += STREAM_UNROLL * stride) {
        uint4 v[STREAM_UNROLL];
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; u++) {
            const size_t j = i + u * stride;
            v[u] = j < words ? __ldcg(p + (j & mask)) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < STREAM_UNROLL; u++) acc.x ^= v[u].x, acc.y ^= v[u].y, acc.z ^= v[u].z, acc.w ^= v[u].w;
    }
    if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x9e3779b9u) atomicAdd(sink, 1u);
}

// The smallest power of two minus one that covers `words` (stream_read's
// mask for a buffer read once).
static size_t cover_mask(size_t words) {
    size_t m = 1;
    while (m < words) m <<= 1;
    return m - 1;
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

// stream_read over `words` words on lane l, 4 blocks of 256 threads per SM.
static void stream_on(const Lane& l, const uint4* p, size_t mask, size_t words, unsigned* sink) {
    CU(cuCtxSetCurrent(l.ctx));
    stream_read<<<l.sms * 4, 256, 0, (cudaStream_t)l.stream>>>(p, mask, words, sink);
    CHECK(cudaGetLastError());
}

// The device's SMs split in two green contexts: `part` of (about) `want`
// SMs and `rest` of the others, each a lane.
struct GreenSplit {
    CUgreenCtx green[2];
    Lane part, rest;
};

static GreenSplit green_split(CUdevice dev, int want) {
    CUdevResource all, res[2];
    CU(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
    unsigned groups = 1;
    CU(cuDevSmResourceSplitByCount(&res[0], &groups, &all, &res[1], 0, want));
    GreenSplit g;
    Lane lanes[2];
    for (int i = 0; i < 2; i++) {
        CUdevResourceDesc desc;
        CU(cuDevResourceGenerateDesc(&desc, &res[i], 1));
        CU(cuGreenCtxCreate(&g.green[i], desc, dev, CU_GREEN_CTX_DEFAULT_STREAM));
        CUcontext ctx;
        CU(cuCtxFromGreenCtx(&ctx, g.green[i]));
        CUstream stream;
        CU(cuGreenCtxStreamCreate(&stream, g.green[i], CU_STREAM_NON_BLOCKING, 0));
        lanes[i] = make_lane(ctx, stream, res[i].sm.smCount);
    }
    g.part = lanes[0], g.rest = lanes[1];
    return g;
}

static void destroy(GreenSplit& g, CUcontext primary) {
    CU(cuCtxSetCurrent(primary));
    for (Lane* l : {&g.part, &g.rest}) {
        BL(cublasDestroy(l->blas));
        CU(cuStreamDestroy(l->stream));
    }
    for (CUgreenCtx c : g.green) CU(cuGreenCtxDestroy(c));
}
