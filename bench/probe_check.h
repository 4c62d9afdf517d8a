/* bench/probe_check.h: the standalone probes' checks (bench/*_probe.cu, compiled alone
 * with nvcc on the GPU host): a failed CUDA runtime (CK) or cuBLAS (CB) call prints where
 * and why, and ends the probe with exit status 1. */
#ifndef MOE_BENCH_PROBE_CHECK_H
#define MOE_BENCH_PROBE_CHECK_H
#include <cublas_api.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(x)                                                                                      \
    do {                                                                                           \
        cudaError_t e_ = (x);                                                                      \
        if (e_ != cudaSuccess) {                                                                   \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));                      \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#define CB(x)                                                                                      \
    do {                                                                                           \
        cublasStatus_t e_ = (x);                                                                   \
        if (e_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            printf("%s:%d cublas status %d\n", __FILE__, __LINE__, (int)e_);                       \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)
#endif
