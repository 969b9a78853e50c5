// What the streaming benchmarks of scripts/ (cuda_boundary_bench.cu,
// cuda_l2_prefetch_bench.cu) share: the int4 decode step's bytes, the
// 16-byte loads the decode kernels stream weights with, a grid's even split
// of a phase, programmatic launches and timing a step as one graph.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>
#include "cuda_check.cuh"

// The int4 Llama-3-8B decode step: 32 layers of five phases, MB each: QKV,
// attention, o, gate/up, down (3.7 GB in all, so nothing comes from L2),
// streamed by blocks of 8 warps.
constexpr int LAYERS = 32, PHASES = 5, THREADS = 256;
const double PHASE_MB[PHASES] = {13.4, 0.5, 8.9, 62.4, 31.2};

struct StepBytes {
    cudaDeviceProp prop;
    int blocks;          // 2 per SM, as the decode kernels' registers allow
    double layer_bytes;  // of one layer's phases
    double bytes;        // of the whole step
    uint4* buf;          // the step's bytes, all set to 1
};

static StepBytes alloc_step_bytes() {
    StepBytes st;
    CHECK(cudaGetDeviceProperties(&st.prop, 0));
    st.blocks = 2 * st.prop.multiProcessorCount;
    st.layer_bytes = 0;
    for (double mb : PHASE_MB) st.layer_bytes += mb * 1e6;
    st.bytes = st.layer_bytes * LAYERS;
    CHECK(cudaMalloc(&st.buf, (size_t)st.bytes + (1 << 20)));
    CHECK(cudaMemset(st.buf, 1, (size_t)st.bytes + (1 << 20)));
    return st;
}

// 16 bytes that skip L1, as the decode kernels read their weights.
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// This block's slice [begin, end) of `units` split evenly over the grid.
__device__ __forceinline__ void block_slice(long long units, long long& begin, long long& end) {
    const long long per_block = (units + gridDim.x - 1) / gridDim.x;
    begin = per_block * blockIdx.x;
    end = min(units, begin + per_block);
}

// Launches `kernel` on `s` so that it may start while the kernel before it
// drains (programmatic stream serialization, as the decode step's kernels).
template <typename... Params, typename... Args>
static void launch_programmatic(void (*kernel)(Params...), int blocks, int threads, int smem, cudaStream_t s,
                                Args... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = blocks;
    cfg.blockDim = threads;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

// µs per replay of what `enqueue` puts on `s`, captured as one graph:
// three replays to warm up, then `reps` timed ones.
template <typename F>
static float time_graph(cudaStream_t s, F enqueue, int reps) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    enqueue();
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(exec, s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; i++) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return ms * 1000.f / reps;
}
