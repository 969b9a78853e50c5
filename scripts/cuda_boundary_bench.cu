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
#include <vector>
#include "cuda_bench_stream.cuh"

constexpr int MAX_AHEAD = 8;

struct Phase {
    const uint4* base;
    long long units;  // 16-byte units
};

// This block's share of a phase: units u = tid, tid + stride, ... of its
// slice. `pre` holds the first `ahead` loads, requested earlier.
template <int AHEAD>
__device__ __forceinline__ unsigned stream_phase(Phase ph, const uint4 (&pre)[MAX_AHEAD]) {
    long long begin, end;
    block_slice(ph.units, begin, end);
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
    block_slice(ph.units, begin, end);
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

// smem: dynamic shared memory per block; 100 KB leaves room for two blocks
// per SM, as the decode kernels' registers do (0: as many as fit).
template <int AHEAD>
static float time_kernels(cudaStream_t s, const std::vector<Phase>& phases, unsigned* sink, int blocks, int smem,
                          int reps) {
    CHECK(cudaFuncSetAttribute(phase_kernel<AHEAD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    return time_graph(s, [&] {
        for (const Phase& ph : phases) {
            launch_programmatic(phase_kernel<AHEAD>, blocks, THREADS, smem, s, ph, sink);
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
    const StepBytes st = alloc_step_bytes();
    std::vector<Phase> phases;
    size_t off = 0;
    for (int l = 0; l < LAYERS; l++)
        for (double mb : PHASE_MB) {
            const long long units = (long long)(mb * 1e6 / 16);
            phases.push_back({st.buf + off, units});
            off += units;
        }
    Phase* d_phases;
    unsigned *count, *sink;
    CHECK(cudaMalloc(&d_phases, phases.size() * sizeof(Phase)));
    CHECK(cudaMemcpy(d_phases, phases.data(), phases.size() * sizeof(Phase), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&count, sizeof(unsigned)));
    CHECK(cudaMalloc(&sink, st.blocks * sizeof(unsigned)));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("%s, %d SMs, %d blocks of %d threads, %.1f MB per layer, %d layers\n", st.prop.name,
           st.prop.multiProcessorCount, st.blocks, THREADS, st.layer_bytes / 1e6, LAYERS);
    for (int smem : {100 << 10, 0}) {
        run<0>(s, phases, d_phases, count, sink, st.blocks, st.bytes, 20, smem);
        run<2>(s, phases, d_phases, count, sink, st.blocks, st.bytes, 20, smem);
        run<4>(s, phases, d_phases, count, sink, st.blocks, st.bytes, 20, smem);
        run<8>(s, phases, d_phases, count, sink, st.blocks, st.bytes, 20, smem);
    }
    phase_shares<4>(s, phases, sink, st.blocks, 100 << 10);
    phase_shares<0>(s, phases, sink, st.blocks, 100 << 10);
    return 0;
}
