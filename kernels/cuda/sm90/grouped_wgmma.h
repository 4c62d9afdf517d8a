/* kernels/cuda/sm90/grouped_wgmma.h: the problems of one launch of the experts' grouped
 * GEMM on Hopper's wgmma (grouped_wgmma.cu), as matmul.cu fills them. Row-major:
 * C (m x n) = A (m x k) B (k x n), or C += it (GW_ACC). A is K-major (a[i * lda + p]) or,
 * with the launch's amn, M-major (a[p * lda + i]); B is K-major (b[j * ldb + p]) or, with
 * bnm, N-major (b[p * ldb + j]). 16-bit operands of one type; C fp32 or (GW_OUT16) of
 * the operands' type. */
#pragma once
#include <stdint.h>

#define GW_MAX 64  /* problems a launch: 27 KB of kernel parameters (CUDA >= 12.1) */
#define GW_SW 32   /* problems a launch with SwiGLU in the epilogue (their maps at i + GW_SW) */
#define GW_OUT16 1 /* C holds 16-bit values */
#define GW_ACC 2   /* C += A B (C's values read) */

typedef struct {
    const uint16_t *a, *b;
    void *c;
    int m, n, k, lda, ldb, ldc;
    int flags; /* GW_OUT16, GW_ACC */
} gw_problem;

typedef struct {
    int count; /* problems */
    gw_problem p[GW_MAX];
} gw_args;
