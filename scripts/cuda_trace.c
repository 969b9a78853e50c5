// Kernel, memcpy and memset timeline of any CUDA program, CUDA graphs
// included (each graph node is its own record), for machines without
// Nsight Systems. A CUPTI injection library: the driver loads it at cuInit.
//   gcc -shared -fPIC -o libtrace.so scripts/cuda_trace.c -I<cuda>/include
//       -I<cupti include> -L<cupti lib> -lcupti -Wl,-rpath,<cupti lib>
//   CUDA_INJECTION64_PATH=$PWD/libtrace.so TRACE_OUT=trace.csv <program>
// scripts/cuda_device_run.sh's `trace` step builds and runs it;
// scripts/cuda_timeline.py summarizes the CSV (Start and Duration in ns).
// CUPTI itself adds host time to every graph launch (~110 µs for a
// 164-kernel decode step on an H100), so time between steps is inflated;
// kernel durations and the gaps inside a step are not.
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

#define BUFFER_BYTES (16 << 20)

static FILE* out;

static void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
    *buf = (uint8_t*)aligned_alloc(8, BUFFER_BYTES);
    *size = BUFFER_BYTES;
    *max_records = 0;
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t* buf, size_t size,
                                      size_t valid) {
    CUpti_Activity* rec = NULL;
    while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel9* k = (const CUpti_ActivityKernel9*)rec;
            fprintf(out, "%llu,%llu,\"%s\",%d,%d,%d\n", (unsigned long long)k->start,
                    (unsigned long long)(k->end - k->start), k->name, k->gridX, k->gridY, k->gridZ);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6* m = (const CUpti_ActivityMemcpy6*)rec;
            fprintf(out, "%llu,%llu,\"memcpy%d_%llu\",0,0,0\n", (unsigned long long)m->start,
                    (unsigned long long)(m->end - m->start), m->copyKind, (unsigned long long)m->bytes);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const CUpti_ActivityMemset4* m = (const CUpti_ActivityMemset4*)rec;
            fprintf(out, "%llu,%llu,\"memset_%llu\",0,0,0\n", (unsigned long long)m->start,
                    (unsigned long long)(m->end - m->start), (unsigned long long)m->bytes);
        }
    }
    free(buf);
}

static void flush_at_exit(void) {
    cuptiActivityFlushAll(1);
    fclose(out);
}

int InitializeInjection(void) {
    const char* path = getenv("TRACE_OUT");
    out = fopen(path ? path : "trace.csv", "w");
    if (!out) return 0;
    fprintf(out, "Start,Duration,Name,GrdX,GrdY,GrdZ\n");
    cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
    cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
    atexit(flush_at_exit);
    return 1;
}
