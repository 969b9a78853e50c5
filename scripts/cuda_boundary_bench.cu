// What a kernel boundary costs in an int4 decode step, against a grid-wide
// barrier inside one persistent kernel (the question behind a per-layer
// decode kernel, BENCHMARKS.md session 17). Both variants stream the same
// bytes: 32 layers of five phases sized like the int4 Llama-3-8B decode
// products (QKV 13.4 MB, attention 0.5 MB, o 8.9 MB, gate/up 62.4 MB, down
// 31.2 MB; 3.7 GB in all, so nothing comes from L2), 2 blocks of 8 warps
// per SM, 16-byte loads that skip L1, as the decode kernels do.
//   kernels:    one kernel per phase, launched programmatically (each waits
//               for the previous grid with griddepcontrol.wait after asking
//               for its first `ahead` loads), the step captured in a graph;
//   persistent: one kernel, the phases separated by a grid barrier (an
//               atomic counter), each block asking for its first `ahead`
//               loads of the next phase before it arrives.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/boundary scripts/cuda_boundary_bench.cu && /tmp/boundary
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x)                                                                  \
    do {                                                                          \
        cudaError_t e = (x);                                                      \
        if (e != cudaSuccess) {                                                   \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

constexpr int LAYERS = 32, PHASES = 5, THREADS = 256, MAX_AHEAD = 8;
// MB of each phase: QKV, attention, o, gate/up, down.
const double PHASE_MB[PHASES] = {13.4, 0.5, 8.9, 62.4, 31.2};

struct Phase {
    const uint4* base;
    long long units;  // 16-byte units
};

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// This block's slice of a phase's units, [begin, end).
__device__ __forceinline__ void block_slice(Phase ph, long long& begin, long long& end) {
    const long long per_block = (ph.units + gridDim.x - 1) / gridDim.x;
    begin = per_block * blockIdx.x;
    end = min(ph.units, begin + per_block);
}

// This block's share of a phase: units u = tid, tid + stride, ... of its
// slice. `pre` holds the first `ahead` loads, requested earlier.
template <int AHEAD>
__device__ __forceinline__ unsigned stream_phase(Phase ph, const uint4 (&pre)[MAX_AHEAD]) {
    long long begin, end;
    block_slice(ph, begin, end);
    unsigned acc = 0;
#pragma unroll
    for (int a = 0; a < AHEAD; a++) acc ^= pre[a].x ^ pre[a].w;
    long long u = begin + threadIdx.x + (long long)AHEAD * THREADS;
    for (; u + 3 * THREADS < end; u += 4 * THREADS) {
        const uint4 v0 = load_stream(ph.base + u), v1 = load_stream(ph.base + u + THREADS);
        const uint4 v2 = load_stream(ph.base + u + 2 * THREADS), v3 = load_stream(ph.base + u + 3 * THREADS);
        acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
    }
    for (; u < end; u += THREADS) acc ^= load_stream(ph.base + u).x;
    return acc;
}

template <int AHEAD>
__device__ __forceinline__ void request_ahead(Phase ph, uint4 (&pre)[MAX_AHEAD]) {
    long long begin, end;
    block_slice(ph, begin, end);
#pragma unroll
    for (int a = 0; a < AHEAD; a++) {
        const long long u = begin + threadIdx.x + (long long)a * THREADS;
        pre[a] = u < end ? load_stream(ph.base + u) : make_uint4(0, 0, 0, 0);
    }
}

template <int AHEAD>
__global__ void __launch_bounds__(THREADS, 2) phase_kernel(Phase ph, unsigned* sink) {
    uint4 pre[MAX_AHEAD];
    request_ahead<AHEAD>(ph, pre);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const unsigned acc = stream_phase<AHEAD>(ph, pre);
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the loads
}

template <int AHEAD>
__global__ void __launch_bounds__(THREADS, 2) persistent_kernel(const Phase* phases, int n, unsigned* count,
                                                                 unsigned* sink) {
    uint4 pre[MAX_AHEAD];
    request_ahead<AHEAD>(phases[0], pre);
    unsigned acc = 0;
    for (int p = 0; p < n; p++) {
        acc ^= stream_phase<AHEAD>(phases[p], pre);
        if (p + 1 == n) break;
        request_ahead<AHEAD>(phases[p + 1], pre);  // the next weights do not depend on this phase
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(count, 1u);
            const unsigned target = (p + 1) * gridDim.x;
            unsigned seen;
            do {
                asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(seen) : "l"(count) : "memory");
            } while (seen < target);
        }
        __syncthreads();
    }
    if (acc == 0x12345678u) sink[blockIdx.x] = acc;
}

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
    return ms * 1000.f / reps;  // µs per step
}

// smem: dynamic shared memory per block; 100 KB leaves room for two blocks
// per SM, as the decode kernels' registers do (0: as many as fit).
template <int AHEAD>
static float time_kernels(cudaStream_t s, const std::vector<Phase>& phases, unsigned* sink, int blocks, int smem,
                          int reps) {
    CHECK(cudaFuncSetAttribute(phase_kernel<AHEAD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return time_graph(s, [&] {
        for (const Phase& ph : phases) {
            cudaLaunchConfig_t cfg = {};
            cfg.gridDim = blocks;
            cfg.blockDim = THREADS;
            cfg.dynamicSmemBytes = smem;
            cfg.stream = s;
            cudaLaunchAttribute attr;
            attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attr.val.programmaticStreamSerializationAllowed = 1;
            cfg.attrs = &attr;
            cfg.numAttrs = 1;
            CHECK(cudaLaunchKernelEx(&cfg, phase_kernel<AHEAD>, ph, sink));
        }
    }, reps);
}

// Each phase's share of a layer in the chain of kernels: the step's time
// less that of the step without that phase's 32 kernels, per layer.
template <int AHEAD>
static void phase_shares(cudaStream_t s, const std::vector<Phase>& phases, unsigned* sink, int blocks, int smem) {
    const char* names[PHASES] = {"QKV", "attention", "o", "gate/up", "down"};
    const float all = time_kernels<AHEAD>(s, phases, sink, blocks, smem, 20);
    printf("smem %3d KB ahead %d, each phase's share of a layer (its bytes at 3.0 TB/s):", smem >> 10, AHEAD);
    for (int q = 0; q < PHASES; q++) {
        std::vector<Phase> rest;
        for (size_t i = 0; i < phases.size(); i++)
            if ((int)(i % PHASES) != q) rest.push_back(phases[i]);
        const float without = time_kernels<AHEAD>(s, rest, sink, blocks, smem, 20);
        printf(" %s %.2f us (%.2f)", names[q], (all - without) / LAYERS, PHASE_MB[q] / 3.0);
    }
    printf("\n");
}

template <int AHEAD>
static void run(cudaStream_t s, const std::vector<Phase>& phases, Phase* d_phases, unsigned* count,
                unsigned* sink, int blocks, double bytes, int reps, int smem) {
    const int n = (int)phases.size();
    CHECK(cudaFuncSetAttribute(persistent_kernel<AHEAD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    const float kernels = time_kernels<AHEAD>(s, phases, sink, blocks, smem, reps);
    const float persistent = time_graph(s, [&] {
        CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned), s));
        persistent_kernel<AHEAD><<<blocks, THREADS, smem, s>>>(d_phases, n, count, sink);
        CHECK(cudaGetLastError());
    }, reps);
    printf("smem %3d KB ahead %d | kernels %8.1f us/step %6.2f us/layer %5.2f TB/s | persistent %8.1f us/step %6.2f us/layer %5.2f TB/s | "
           "boundary cost %5.2f us/layer\n",
           smem >> 10, AHEAD, kernels, kernels / LAYERS, bytes / kernels / 1e6, persistent, persistent / LAYERS,
           bytes / persistent / 1e6, (kernels - persistent) / LAYERS);
}

int main() {
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    const int blocks = 2 * prop.multiProcessorCount;
    double layer_bytes = 0;
    for (double mb : PHASE_MB) layer_bytes += mb * 1e6;
    const double bytes = layer_bytes * LAYERS;
    uint4* buf;
    CHECK(cudaMalloc(&buf, (size_t)bytes + (1 << 20)));
    CHECK(cudaMemset(buf, 1, (size_t)bytes + (1 << 20)));
    std::vector<Phase> phases;
    size_t off = 0;
    for (int l = 0; l < LAYERS; l++)
        for (double mb : PHASE_MB) {
            const long long units = (long long)(mb * 1e6 / 16);
            phases.push_back({buf + off, units});
            off += units;
        }
    Phase* d_phases;
    unsigned *count, *sink;
    CHECK(cudaMalloc(&d_phases, phases.size() * sizeof(Phase)));
    CHECK(cudaMemcpy(d_phases, phases.data(), phases.size() * sizeof(Phase), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&count, sizeof(unsigned)));
    CHECK(cudaMalloc(&sink, blocks * sizeof(unsigned)));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("%s, %d SMs, %d blocks of %d threads, %.1f MB per layer, %d layers\n", prop.name,
           prop.multiProcessorCount, blocks, THREADS, layer_bytes / 1e6, LAYERS);
    for (int smem : {100 << 10, 0}) {
        run<0>(s, phases, d_phases, count, sink, blocks, bytes, 20, smem);
        run<2>(s, phases, d_phases, count, sink, blocks, bytes, 20, smem);
        run<4>(s, phases, d_phases, count, sink, blocks, bytes, 20, smem);
        run<8>(s, phases, d_phases, count, sink, blocks, bytes, 20, smem);
    }
    phase_shares<4>(s, phases, sink, blocks, 100 << 10);
    phase_shares<0>(s, phases, sink, blocks, 100 << 10);
    return 0;
}
