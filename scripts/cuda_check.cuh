// Error checks shared by the CUDA benchmarks of scripts/: the runtime API
// (CHECK), the driver API (CU) and cuBLAS (BL); each prints the failing call
// and exits.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)
#define CU(x)                                                             \
    do {                                                                  \
        CUresult e = (x);                                                 \
        if (e != CUDA_SUCCESS) {                                          \
            const char* s = "?";                                          \
            cuGetErrorString(e, &s);                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); \
            exit(1);                                                      \
        }                                                                 \
    } while (0)
#define BL(x)                                                                           \
    do {                                                                                \
        cublasStatus_t e = (x);                                                         \
        if (e != CUBLAS_STATUS_SUCCESS) {                                               \
            fprintf(stderr, "%s:%d %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, (int)e); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)
