// Whether cuBLAS's default choice for the 8B step's GEMMs leaves speed on the
// table: for each shape (rows × n × k, `y = x · wᵀ`, bf16 in and out, f32
// accumulation, random N(0,1) activations and N(0,0.02) weights) it times
// cublasGemmEx with CUBLAS_GEMM_DEFAULT, as the engine calls it, and every
// algorithm cublasLt's heuristic offers (up to 16, the engine's 32 MB
// workspace), in ROUNDS interleaved rounds (so that clock and power drift
// fall on every candidate alike), and prints the medians of the default and
// of the best.
// Build and run on the GPU machine:
//   nvcc -O3 -arch=sm_90a -o /tmp/algos scripts/cuda_gemm_algos_bench.cu -lcublas -lcublasLt -lcurand && /tmp/algos
#include <algorithm>
#include <array>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <curand.h>
#include <vector>
#include "cuda_check.cuh"

constexpr size_t WORKSPACE = 32 << 20;
constexpr int REPS = 10, ROUNDS = 5;

__global__ void to_bf16(const float* in, __nv_bfloat16* out, size_t n, float scale) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(in[i] * scale);
}

static __nv_bfloat16* random_bf16(curandGenerator_t gen, size_t n, float scale) {
    float* f;
    __nv_bfloat16* b;
    CHECK(cudaMalloc(&f, n * 4));
    CHECK(cudaMalloc(&b, n * 2));
    curandGenerateNormal(gen, f, n, 0.0f, 1.0f);
    to_bf16<<<1024, 256>>>(f, b, n, scale);
    CHECK(cudaFree(f));
    return b;
}

template <class F>
static float time_us(F f) {
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) f();
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < REPS; i++) f();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1000.0f / REPS;
}

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Tuned {
    int m, n, k;
    bool f32;
    cublasLtMatmulAlgo_t algo;
    bool use;  // the best algorithm beat the default
};

// 32 layers of the four projections at `rows` rows (distinct weights per
// layer, 7 GB in all, as a step reads them), the default against the
// per-shape best algorithms, alternating for ROUNDS rounds: the comparison
// under a real step's sustained power draw.
static void layer_runs(cublasHandle_t blas, cublasLtHandle_t lt, void* ws, curandGenerator_t gen,
                       const std::vector<Tuned>& tuned) {
    constexpr int LAYERS = 32;
    const int nk[4][2] = {{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}};
    std::vector<__nv_bfloat16*> weights;
    for (int l = 0; l < LAYERS; l++)
        for (auto& p : nk) weights.push_back(random_bf16(gen, (size_t)p[0] * p[1], 0.02f));
    printf("\n| rows | 32 layers, default (ms) | tuned (ms) | gain |\n|---:|---:|---:|---:|\n");
    for (int rows : {256, 1024, 4096, 16384}) {
        __nv_bfloat16* x = random_bf16(gen, (size_t)rows * 14336, 1.0f);
        void* y;
        CHECK(cudaMalloc(&y, (size_t)rows * 28672 * 2));
        const float one = 1.0f, zero = 0.0f;
        struct Op {
            cublasLtMatmulDesc_t desc;
            cublasLtMatrixLayout_t la, lb, lc;
            const Tuned* t;
        } ops[4];
        for (int p = 0; p < 4; p++) {
            const int n = nk[p][0], k = nk[p][1];
            Op& o = ops[p];
            o.t = nullptr;
            for (auto& t : tuned)
                if (t.m == rows && t.n == n && t.k == k && !t.f32) o.t = &t;
            BL(cublasLtMatmulDescCreate(&o.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
            cublasOperation_t tr = CUBLAS_OP_T, nn = CUBLAS_OP_N;
            BL(cublasLtMatmulDescSetAttribute(o.desc, CUBLASLT_MATMUL_DESC_TRANSA, &tr, sizeof tr));
            BL(cublasLtMatmulDescSetAttribute(o.desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
            BL(cublasLtMatrixLayoutCreate(&o.la, CUDA_R_16BF, k, n, k));
            BL(cublasLtMatrixLayoutCreate(&o.lb, CUDA_R_16BF, k, rows, k));
            BL(cublasLtMatrixLayoutCreate(&o.lc, CUDA_R_16BF, n, rows, n));
        }
        auto step = [&](bool use_tuned) {
            for (int l = 0; l < LAYERS; l++)
                for (int p = 0; p < 4; p++) {
                    const int n = nk[p][0], k = nk[p][1];
                    const __nv_bfloat16* w = weights[4 * l + p];
                    if (use_tuned && ops[p].t && ops[p].t->use)
                        BL(cublasLtMatmul(lt, ops[p].desc, &one, w, ops[p].la, x, ops[p].lb, &zero, y, ops[p].lc, y,
                                          ops[p].lc, &ops[p].t->algo, ws, WORKSPACE, 0));
                    else
                        BL(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, rows, k, &one, w, CUDA_R_16BF, k, x,
                                        CUDA_R_16BF, k, &zero, y, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                                        CUBLAS_GEMM_DEFAULT));
                }
        };
        std::vector<float> a, b;
        for (int r = 0; r < ROUNDS; r++) {
            a.push_back(time_us([&] { step(false); }) / 1000.0f);
            b.push_back(time_us([&] { step(true); }) / 1000.0f);
        }
        const float ta = median(a), tb = median(b);
        printf("| %d | %.2f | %.2f | %+.1f %% |\n", rows, ta, tb, (ta / tb - 1) * 100);
        fflush(stdout);
        for (auto& o : ops) {
            cublasLtMatrixLayoutDestroy(o.la);
            cublasLtMatrixLayoutDestroy(o.lb);
            cublasLtMatrixLayoutDestroy(o.lc);
            cublasLtMatmulDescDestroy(o.desc);
        }
        CHECK(cudaFree(x));
        CHECK(cudaFree(y));
    }
    for (auto* w : weights) CHECK(cudaFree(w));
}


int main() {
    // rows × n × k × (1: f32 output, as the LM head's logits)
    std::vector<std::array<int, 4>> shapes;
    for (int rows : {16, 64, 128, 256, 512, 1024, 4096, 16384})
        for (auto nk : {std::array<int, 2>{6144, 4096}, {4096, 4096}, {28672, 4096}, {4096, 14336}})
            shapes.push_back({rows, nk[0], nk[1], 0});
    for (int rows : {16, 256, 1024}) shapes.push_back({rows, 128256, 4096, 1});
    curandGenerator_t gen;
    curandCreateGenerator(&gen, CURAND_RNG_PSEUDO_DEFAULT);
    curandSetPseudoRandomGeneratorSeed(gen, 7);
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    BL(cublasCreate(&blas));
    BL(cublasLtCreate(&lt));
    void* ws;
    CHECK(cudaMalloc(&ws, WORKSPACE));
    BL(cublasSetWorkspace(blas, ws, WORKSPACE));
    // Per rows: each projection's best algorithm (or none: the default), for the layer runs below.
    std::vector<Tuned> tuned;
    printf("| rows × n × k | default µs | TFLOP/s | best µs (algo #) | TFLOP/s | gain | spread of the default |\n"
           "|---|---:|---:|---:|---:|---:|---:|\n");
    for (auto& s : shapes) {
        const int m = s[0], n = s[1], k = s[2];
        const bool f32 = s[3];
        const cudaDataType yt = f32 ? CUDA_R_32F : CUDA_R_16BF;
        __nv_bfloat16* x = random_bf16(gen, (size_t)m * k, 1.0f);
        __nv_bfloat16* w = random_bf16(gen, (size_t)n * k, 0.02f);
        void* y;
        CHECK(cudaMalloc(&y, (size_t)m * n * 4));
        const float one = 1.0f, zero = 0.0f;
        cublasLtMatmulDesc_t desc;
        BL(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
        BL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
        BL(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof nn));
        cublasLtMatrixLayout_t la, lb, lc;
        BL(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, n, k));
        BL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, m, k));
        BL(cublasLtMatrixLayoutCreate(&lc, yt, n, m, n));
        cublasLtMatmulPreference_t pref;
        BL(cublasLtMatmulPreferenceCreate(&pref));
        size_t wsb = WORKSPACE;
        BL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
        cublasLtMatmulHeuristicResult_t res[16];
        int found = 0;
        BL(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 16, res, &found));
        // Candidate 0: cublasGemmEx as the engine calls it; i + 1: heuristic result i.
        std::vector<std::vector<float>> times(found + 1);
        for (int round = 0; round < ROUNDS; round++) {
            times[0].push_back(time_us([&] {
                BL(cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &one, w, CUDA_R_16BF, k, x, CUDA_R_16BF,
                                k, &zero, y, yt, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
            }));
            for (int i = 0; i < found; i++) {
                if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
                times[i + 1].push_back(time_us([&] {
                    BL(cublasLtMatmul(lt, desc, &one, w, la, x, lb, &zero, y, lc, y, lc, &res[i].algo, ws,
                                      WORKSPACE, 0));
                }));
            }
        }
        const float t_default = median(times[0]);
        const float spread = *std::max_element(times[0].begin(), times[0].end()) /
                             *std::min_element(times[0].begin(), times[0].end());
        float best = 1e30f;
        int best_i = -1;
        for (int i = 0; i < found; i++)
            if (!times[i + 1].empty() && median(times[i + 1]) < best) best = median(times[i + 1]), best_i = i;
        const double flop = 2.0 * m * n * k;
        tuned.push_back({m, n, k, f32, best_i >= 0 && best < t_default ? res[best_i].algo : cublasLtMatmulAlgo_t{},
                         best_i >= 0 && best < t_default});
        printf("| %d × %d × %d%s | %.1f | %.0f | %.1f (#%d of %d) | %.0f | %+.1f %% | %.1f %% |\n", m, n, k,
               f32 ? " (f32 out)" : "", t_default, flop / t_default / 1e6, best, best_i, found, flop / best / 1e6,
               (t_default / best - 1) * 100, (spread - 1) * 100);
        fflush(stdout);
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
        CHECK(cudaFree(x));
        CHECK(cudaFree(w));
        CHECK(cudaFree(y));
    }
    layer_runs(blas, lt, ws, gen, tuned);
    return 0;
}
