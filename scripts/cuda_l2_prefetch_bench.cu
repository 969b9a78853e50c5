// Whether prefetching the next product's weights into L2 lifts the int4
// decode step's streaming rate (BENCHMARKS.md session 24). The step is
// modelled as cuda_boundary_bench.cu models it: 32 layers of five phases
// sized like the int4 Llama-3-8B decode products (QKV 13.4 MB, attention
// 0.5 MB, o 8.9 MB, gate/up 62.4 MB, down 31.2 MB), one programmatically
// launched kernel per phase in a graph, 2 blocks of 8 warps per SM, 16-byte
// loads that skip L1. The attention phase can also hold the GPU for `spin`
// ns after its loads, as the real batch-1 attention does (its dependent
// latency leaves the memory bus idle for ~3.5 us a layer).
// Each kernel may issue `cp.async.bulk.prefetch.L2` for the first `cap` MB
// of the next phase's bytes:
//   start: before it waits for the previous grid;
//   end:   each block, after streaming its own slice (the drain);
// and may stream its own bytes with an L2 evict_first policy so that it does
// not displace what was prefetched.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/l2pf scripts/cuda_l2_prefetch_bench.cu && /tmp/l2pf
#include <cstdint>
#include <vector>
#include "cuda_bench_stream.cuh"

struct Phase {
    const uint4* base;
    long long units;  // 16-byte units
    const uint4* next;
    long long next_units;
    long long spin_ns;  // idle time after the loads (the attention phase's latency)
};

enum Prefetch { NONE = 0, AT_START = 1, AT_END = 2 };

struct Mode {
    int prefetch;
    long long cap_units;  // at most this much of the next phase
    int evict_first;
};

// load_stream with an L2 evict_first policy when asked for.
__device__ __forceinline__ uint4 load_phase(const uint4* p, bool evict_first, uint64_t policy) {
    if (!evict_first) return load_stream(p);
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

// The block's share of the first `cap` units of the next phase, one bulk
// prefetch per thread.
__device__ __forceinline__ void prefetch_next(const Phase& ph, const Mode& m) {
    const long long units = min(ph.next_units, m.cap_units);
    if (ph.next == nullptr || units == 0) return;
    long long begin, end;
    block_slice(units, begin, end);
    const long long per_thread = (end - begin + THREADS - 1) / THREADS;
    const long long a = begin + per_thread * threadIdx.x, b = min(end, a + per_thread);
    if (a < b) {
        const unsigned bytes = (unsigned)((b - a) * 16);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ph.next + a), "r"(bytes) : "memory");
    }
}

__global__ void __launch_bounds__(THREADS, 2) phase_kernel(Phase ph, Mode m, unsigned* sink) {
    uint64_t policy = 0;
    if (m.evict_first) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    if (m.prefetch == AT_START) prefetch_next(ph, m);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    long long begin, end;
    block_slice(ph.units, begin, end);
    unsigned acc = 0;
    long long u = begin + threadIdx.x;
    for (; u + 3 * THREADS < end; u += 4 * THREADS) {
        const uint4 v0 = load_phase(ph.base + u, m.evict_first, policy);
        const uint4 v1 = load_phase(ph.base + u + THREADS, m.evict_first, policy);
        const uint4 v2 = load_phase(ph.base + u + 2 * THREADS, m.evict_first, policy);
        const uint4 v3 = load_phase(ph.base + u + 3 * THREADS, m.evict_first, policy);
        acc ^= v0.x ^ v1.y ^ v2.z ^ v3.w;
    }
    for (; u < end; u += THREADS) acc ^= load_phase(ph.base + u, m.evict_first, policy).x;
    if (m.prefetch == AT_END) prefetch_next(ph, m);
    if (ph.spin_ns > 0) {
        uint64_t t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); while (t - t0 < (uint64_t)ph.spin_ns);
    }
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    if (acc == 0x12345678u) sink[blockIdx.x] = acc;  // keeps the loads
}

static float time_step(cudaStream_t s, const std::vector<Phase>& phases, Mode m, unsigned* sink, int blocks) {
    CHECK(cudaFuncSetAttribute(phase_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 << 10));
    return time_graph(s, [&] {
        for (const Phase& ph : phases) {
            // 100 KB of shared memory: two blocks a SM, as the decode kernels' registers allow.
            launch_programmatic(phase_kernel, blocks, THREADS, 100 << 10, s, ph, m, sink);
        }
    }, 20);
}

int main() {
    const StepBytes st = alloc_step_bytes();
    unsigned* sink;
    CHECK(cudaMalloc(&sink, st.blocks * sizeof(unsigned)));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    printf("%s, %d SMs, L2 %d MB, %d blocks of %d threads, %.1f MB per layer, %d layers\n", st.prop.name,
           st.prop.multiProcessorCount, st.prop.l2CacheSize >> 20, st.blocks, THREADS, st.layer_bytes / 1e6, LAYERS);
    // One kernel over all the bytes: the bus's streaming rate without boundaries.
    {
        std::vector<Phase> one = {{st.buf, (long long)(st.bytes / 16), nullptr, 0, 0}};
        const float us = time_step(s, one, Mode{NONE, 0, 0}, sink, st.blocks);
        printf("one kernel over %.2f GB: %.1f us, %.2f TB/s\n", st.bytes / 1e9, us, st.bytes / us / 1e6);
    }
    for (long long spin : {0LL, 3500LL}) {
        std::vector<Phase> phases;
        size_t off = 0;
        for (int l = 0; l < LAYERS; l++)
            for (int q = 0; q < PHASES; q++) {
                const long long units = (long long)(PHASE_MB[q] * 1e6 / 16);
                phases.push_back({st.buf + off, units, nullptr, 0, q == 1 ? spin : 0});
                off += units;
            }
        for (size_t i = 0; i + 1 < phases.size(); i++) {
            phases[i].next = phases[i + 1].base;
            phases[i].next_units = phases[i + 1].units;
        }
        const float base = time_step(s, phases, Mode{NONE, 0, 0}, sink, st.blocks);
        printf("attention spin %lld ns | no prefetch: %.2f us/layer, %.2f TB/s\n", spin, base / LAYERS,
               st.bytes / base / 1e6);
        const char* where[] = {"", "start", "end"};
        for (int pf : {AT_START, AT_END})
            for (int ef : {0, 1})
                for (double cap_mb : {2.0, 4.0, 8.0, 16.0, 64.0}) {
                    const Mode m{pf, (long long)(cap_mb * 1e6 / 16), ef};
                    const float us = time_step(s, phases, m, sink, st.blocks);
                    printf("attention spin %lld ns | prefetch at %-5s cap %4.0f MB evict_first %d: %.2f us/layer, "
                           "%.2f TB/s (%+.2f us/layer)\n",
                           spin, where[pf], cap_mb, ef, us / LAYERS, st.bytes / us / 1e6, (us - base) / LAYERS);
                }
    }
    return 0;
}
