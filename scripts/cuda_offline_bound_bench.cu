// How fast issue 9's offline workload (1 000 requests of 512 prompt + 256
// output tokens, Llama-3-8B shape, bf16 weights, fp8 KV) could run on this
// GPU if nothing but its projections and its decode attention's KV reads
// had to be done (BENCHMARKS.md "GPU limits"). One eighth of the workload, so
// the rates are those of the real shapes:
//   - prompt GEMMs: 64 000 tokens in two 32 000-row chunks, 32 layers of
//     the four projections (distinct random weights per layer, 7 GB);
//   - decode GEMMs: 32 steps of 1 024 rows (1 000 padded, as the decode
//     graphs do), the four projections of 32 layers and the LM head;
//   - decode attention as bytes: 1/8 of the 10.7 TB of fp8 keys and values
//     the 255 decode steps read, streamed by 16-byte loads (a 4 GB buffer,
//     eight loads in flight per thread, 4 blocks of 256 threads per SM).
// Printed: each part alone on the whole GPU; the stream on a green context
// of R SMs running *under* the prompt GEMMs on the other SMs (the best case
// of a nano-batch schedule: every byte of decode attention hidden under
// prompt GEMMs, no data dependencies), then the decode GEMMs on the whole
// GPU; and the output tok/s each schedule gives for the whole workload.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/bound scripts/cuda_offline_bound_bench.cu -lcuda -lcublas && /tmp/bound
#include <chrono>
#include <cuda_bf16.h>
#include <vector>
#include "cuda_green.cuh"

constexpr int LAYERS = 32, HIDDEN = 4096, INTER = 14336, QKV = 6144, VOCAB = 128256;
constexpr int SCALE = 8;                   // the workload is divided by this
constexpr int PROMPT_CHUNK = 32000;        // rows of a prompt step
constexpr int PROMPT_CHUNKS = 2;           // 1 000 × 512 / SCALE tokens
constexpr int DECODE_ROWS = 1024;          // 1 000 sequences, padded
constexpr int DECODE_STEPS = 32;           // 255 / SCALE, rounded
constexpr double KV_BYTES = 10.7e12 / SCALE;
constexpr double OUTPUT_TOKENS = 256000.0 / SCALE;

__global__ void fill_random(__nv_bfloat16* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = __float2bfloat16(((h & 0xffff) / 65536.0f - 0.5f) * 0.07f);
    }
}

struct Model {
    std::vector<__nv_bfloat16*> w;  // per layer: qkv, o, gate/up, down
    __nv_bfloat16* head;
    __nv_bfloat16 *x, *y;           // activations, big enough for any product
    uint4* kv;
    size_t kv_mask;  // the KV buffer is kv_mask + 1 words, read round and round
    unsigned* sink;
};

// y[rows, n] = x[rows, k] · w[n, k]ᵀ.
static void gemm(const Lane& l, const __nv_bfloat16* w, const Model& m, int rows, int n, int k) {
    const float one = 1.f, zero = 0.f;
    BL(cublasGemmEx(l.blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, CUDA_R_16BF, k, m.x, CUDA_R_16BF, k,
                      &zero, m.y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static void layers(const Lane& l, const Model& m, int rows) {
    CU(cuCtxSetCurrent(l.ctx));
    const int shapes[4][2] = {{QKV, HIDDEN}, {HIDDEN, HIDDEN}, {2 * INTER, HIDDEN}, {HIDDEN, INTER}};
    for (int layer = 0; layer < LAYERS; layer++)
        for (int p = 0; p < 4; p++) gemm(l, m.w[4 * layer + p], m, rows, shapes[p][0], shapes[p][1]);
}

static void prompt_gemms(const Lane& l, const Model& m) {
    for (int c = 0; c < PROMPT_CHUNKS; c++) layers(l, m, PROMPT_CHUNK);
}

static void decode_gemms(const Lane& l, const Model& m) {
    for (int s = 0; s < DECODE_STEPS; s++) {
        layers(l, m, DECODE_ROWS);
        gemm(l, m.head, m, DECODE_ROWS, VOCAB, HIDDEN);
    }
}

static void kv_stream(const Lane& l, const Model& m) {
    stream_on(l, m.kv, m.kv_mask, (size_t)(KV_BYTES / 16), m.sink);
}

template <typename F>
static double seconds(F body, std::initializer_list<const Lane*> lanes) {
    for (auto* l : lanes) CU(cuStreamSynchronize(l->stream));
    const auto t0 = std::chrono::steady_clock::now();
    body();
    for (auto* l : lanes) CU(cuStreamSynchronize(l->stream));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
    CU(cuInit(0));
    CUdevice dev;
    CU(cuDeviceGet(&dev, 0));
    CHECK(cudaSetDevice(0));
    CHECK(cudaFree(nullptr));
    CUcontext primary;
    CU(cuCtxGetCurrent(&primary));
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));

    Model m;
    const size_t per_layer[4] = {(size_t)QKV * HIDDEN, (size_t)HIDDEN * HIDDEN, (size_t)2 * INTER * HIDDEN,
                                 (size_t)HIDDEN * INTER};
    unsigned seed = 1;
    auto random = [&](size_t n) {
        __nv_bfloat16* p;
        CHECK(cudaMalloc(&p, n * 2));
        fill_random<<<4 * sms, 256>>>(p, n, seed++ * 0x9e3779b9u);
        CHECK(cudaGetLastError());
        return p;
    };
    for (int layer = 0; layer < LAYERS; layer++)
        for (size_t n : per_layer) m.w.push_back(random(n));
    m.head = random((size_t)VOCAB * HIDDEN);
    m.x = random((size_t)PROMPT_CHUNK * INTER);
    CHECK(cudaMalloc(&m.y, (size_t)PROMPT_CHUNK * 2 * INTER * 2));
    const size_t kv_words = (4ull << 30) / 16;
    m.kv_mask = kv_words - 1;
    CHECK(cudaMalloc(&m.kv, kv_words * 16));
    CHECK(cudaMemset(m.kv, 1, kv_words * 16));
    CHECK(cudaMalloc(&m.sink, 4));
    CHECK(cudaDeviceSynchronize());

    CUstream s1, s2;
    CU(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING));
    CU(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    const Lane full = make_lane(primary, s1, sms), full2 = make_lane(primary, s2, sms);

    prompt_gemms(full, m);  // warm-up: cuBLAS heuristics, clocks
    decode_gemms(full, m);
    const double t_prompt = seconds([&] { prompt_gemms(full, m); }, {&full});
    const double t_decode = seconds([&] { decode_gemms(full, m); }, {&full});
    const double t_kv = seconds([&] { kv_stream(full2, m); }, {&full2});
    const double t_both = seconds([&] { prompt_gemms(full, m), kv_stream(full2, m); }, {&full, &full2});
    auto tok_s = [](double t) { return OUTPUT_TOKENS / t; };
    printf("%s, %d SMs; 1/%d of 1 000 x (512 + 256), output tok/s for the whole workload\n", prop.name, sms, SCALE);
    printf("| schedule | s (this eighth) | output tok/s |\n|---|---:|---:|\n");
    printf("| prompt GEMMs alone (%.0f TFLOP/s) | %.3f | |\n",
           2.0 * PROMPT_CHUNKS * PROMPT_CHUNK * LAYERS * (double)(per_layer[0] + per_layer[1] + per_layer[2] + per_layer[3]) /
               t_prompt / 1e12,
           t_prompt);
    printf("| decode GEMMs alone (LM head included) | %.3f | |\n", t_decode);
    printf("| KV bytes alone (%.2f TB/s) | %.3f | |\n", KV_BYTES / t_kv / 1e12, t_kv);
    printf("| GEMMs only | %.3f | %.0f |\n", t_prompt + t_decode, tok_s(t_prompt + t_decode));
    printf("| GEMMs, then the KV bytes | %.3f | %.0f |\n", t_prompt + t_decode + t_kv, tok_s(t_prompt + t_decode + t_kv));
    printf("| KV bytes beside the prompt GEMMs, two plain streams, then decode GEMMs | %.3f | %.0f |\n",
           t_both + t_decode, tok_s(t_both + t_decode));

    for (int want : {8, 16, 24}) {
        GreenSplit split = green_split(dev, want);
        const Lane &kv = split.part, &g = split.rest;
        prompt_gemms(g, m);  // the partition's own heuristics
        const double t_under = seconds([&] { prompt_gemms(g, m), kv_stream(kv, m); }, {&g, &kv});
        const double t_g = seconds([&] { prompt_gemms(g, m); }, {&g});
        printf("| KV bytes on %d SMs under the prompt GEMMs on %d (those alone: %.3f s), then decode GEMMs | %.3f | %.0f |\n",
               kv.sms, g.sms, t_g, t_under + t_decode, tok_s(t_under + t_decode));
        destroy(split, primary);
    }
    return 0;
}
