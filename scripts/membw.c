// Machine limits for the CPU benchmarks: memory read bandwidth and f32 FMA
// peak, for 1 and for T threads (T = --threads, default 2).
//
//   bandwidth: each thread sums its share of a buffer far larger than the
//              last-level cache (default 1 GiB), best of N passes, GB/s (1e9 B/s).
//   peak:      each thread runs 2*ACC independent FMA chains on full vector
//              registers (AVX-512 when compiled with it, else AVX2+FMA), GFLOP/s
//              counting an FMA as 2 FLOPs.
//
// build: cc -O2 -march=native -pthread -o membw scripts/membw.c
// usage: membw [--threads T] [--mib SIZE] [--reps N] [--json]
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__)
#define ISA "avx512"
typedef __m512 vec;
#define LANES 16
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_load_ps(p)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSUM(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA "avx2"
typedef __m256 vec;
#define LANES 8
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_load_ps(p)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float VSUM(__m256 a) {
    float t[8];
    _mm256_storeu_ps(t, a);
    return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
#error "membw.c needs AVX2+FMA or AVX-512 (compile with -march=native on x86-64)"
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    int id, nthreads;
    float *buf;
    size_t n;  // floats in the whole buffer
    pthread_barrier_t *barrier;
    int reps;
    double *starts, *ends;  // per rep, per thread
    float sink;
    long fma_iters;
    int mode;  // 0 = bandwidth, 1 = fma
} task;

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu % CPU_SETSIZE, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);  // best effort
}

static float sum_range(const float *p, size_t n) {
    vec a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
    for (size_t i = 0; i + 4 * LANES <= n; i += 4 * LANES) {
        a0 = VADD(a0, VLOAD(p + i));
        a1 = VADD(a1, VLOAD(p + i + LANES));
        a2 = VADD(a2, VLOAD(p + i + 2 * LANES));
        a3 = VADD(a3, VLOAD(p + i + 3 * LANES));
    }
    return VSUM(VADD(VADD(a0, a1), VADD(a2, a3)));
}

// 12 independent accumulators cover FMA latency (4 cycles) x 2 ports with margin.
static float fma_loop(long iters) {
    vec x = VSET1(0.999f), y = VSET1(1e-7f);
    vec c0 = VSET1(1), c1 = VSET1(2), c2 = VSET1(3), c3 = VSET1(4), c4 = VSET1(5), c5 = VSET1(6);
    vec c6 = VSET1(7), c7 = VSET1(8), c8 = VSET1(9), c9 = VSET1(10), c10 = VSET1(11), c11 = VSET1(12);
    for (long i = 0; i < iters; i++) {
        c0 = VFMA(c0, x, y); c1 = VFMA(c1, x, y); c2 = VFMA(c2, x, y); c3 = VFMA(c3, x, y);
        c4 = VFMA(c4, x, y); c5 = VFMA(c5, x, y); c6 = VFMA(c6, x, y); c7 = VFMA(c7, x, y);
        c8 = VFMA(c8, x, y); c9 = VFMA(c9, x, y); c10 = VFMA(c10, x, y); c11 = VFMA(c11, x, y);
        __asm__ volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5));
    }
    vec s = VADD(VADD(VADD(c0, c1), VADD(c2, c3)), VADD(VADD(c4, c5), VADD(c6, c7)));
    return VSUM(VADD(s, VADD(VADD(c8, c9), VADD(c10, c11))));
}
#define FMA_CHAINS 12

static void *worker(void *arg) {
    task *t = arg;
    pin(t->id);
    size_t per = t->n / t->nthreads;
    float *mine = t->buf + per * t->id;
    if (t->mode == 0) {
        for (size_t i = 0; i < per; i++) mine[i] = (float)(i & 7);  // first touch on this thread's node
    }
    for (int r = 0; r < t->reps; r++) {
        pthread_barrier_wait(t->barrier);
        t->starts[r * t->nthreads + t->id] = now();
        t->sink += t->mode == 0 ? sum_range(mine, per) : fma_loop(t->fma_iters);
        t->ends[r * t->nthreads + t->id] = now();
    }
    return NULL;
}

// Returns the best (shortest) wall time of one rep: first start to last end.
static double run(int mode, int nthreads, float *buf, size_t n, int reps, long fma_iters) {
    pthread_t th[256];
    task ts[256];
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, nthreads);
    double *starts = calloc((size_t)reps * nthreads, sizeof(double));
    double *ends = calloc((size_t)reps * nthreads, sizeof(double));
    for (int i = 0; i < nthreads; i++) {
        ts[i] = (task){.id = i, .nthreads = nthreads, .buf = buf, .n = n, .barrier = &barrier, .reps = reps,
                       .starts = starts, .ends = ends, .fma_iters = fma_iters, .mode = mode};
        pthread_create(&th[i], NULL, worker, &ts[i]);
    }
    float sink = 0;
    for (int i = 0; i < nthreads; i++) {
        pthread_join(th[i], NULL);
        sink += ts[i].sink;
    }
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double s = 1e30, e = 0;
        for (int i = 0; i < nthreads; i++) {
            if (starts[r * nthreads + i] < s) s = starts[r * nthreads + i];
            if (ends[r * nthreads + i] > e) e = ends[r * nthreads + i];
        }
        if (e - s < best) best = e - s;
    }
    if (sink == 12345.678f) fprintf(stderr, "%f\n", sink);  // keeps the sums alive
    free(starts);
    free(ends);
    pthread_barrier_destroy(&barrier);
    return best;
}

int main(int argc, char **argv) {
    int threads = 2, reps = 10, json = 0;
    size_t mib = 1024;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json")) json = 1;
        else {
            fprintf(stderr, "usage: %s [--threads T] [--mib SIZE] [--reps N] [--json]\n", argv[0]);
            return 2;
        }
    }
    if (threads < 1 || threads > 256 || reps < 1 || mib < 1) {
        fprintf(stderr, "membw: --threads must be 1..256, --reps and --mib at least 1\n");
        return 2;
    }
    size_t n = mib * 1024 * 1024 / sizeof(float);
    n -= n % ((size_t)threads * 4 * LANES);
    float *buf = aligned_alloc(64, n * sizeof(float));
    if (!buf) {
        fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib);
        return 1;
    }
    const long fma_iters = 100 * 1000 * 1000;  // ~0.3-0.5 s per rep on one core
    const int fma_reps = 3;
    double flops = (double)fma_iters * FMA_CHAINS * LANES * 2;
    int counts[2] = {1, threads};
    double bw[2], peak[2];
    for (int k = 0; k < 2; k++) {
        bw[k] = (double)(n / threads * threads) * sizeof(float) / run(0, counts[k], buf, n, reps, 0) / 1e9;
        peak[k] = flops * counts[k] / run(1, counts[k], NULL, 0, fma_reps, fma_iters) / 1e9;
    }
    free(buf);
    if (json) {
        printf("{\"isa\":\"%s\",\"threads\":%d,\"buffer_mib\":%zu,\"bw_gbs_1t\":%.2f,\"bw_gbs\":%.2f,"
               "\"fma_gflops_1t\":%.1f,\"fma_gflops\":%.1f}\n",
               ISA, threads, mib, bw[0], bw[1], peak[0], peak[1]);
    } else {
        printf("vector ISA          %s\n", ISA);
        printf("read bandwidth      1 thread: %.2f GB/s   %d threads: %.2f GB/s   (%zu MiB buffer, best of %d)\n",
               bw[0], threads, bw[1], mib, reps);
        printf("f32 FMA peak        1 thread: %.1f GFLOP/s   %d threads: %.1f GFLOP/s\n", peak[0], threads, peak[1]);
    }
    return 0;
}
