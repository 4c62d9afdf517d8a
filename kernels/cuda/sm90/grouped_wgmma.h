/* kernels/cuda/sm90/grouped_wgmma.h: the problems of one launch of the experts' grouped
 * GEMM on Hopper's wgmma (grouped_wgmma.cu), as matmul.cu fills them. Row-major:
 * C (m x n) = A (m x k) B (k x n), or C += it (GW_ACC). A is K-major (a[i * lda + p]) or,
 * with the launch's amn, M-major (a[p * lda + i]); B is K-major (b[j * ldb + p]) or, with
 * bnm, N-major (b[p * ldb + j]). 16-bit operands of one type; C fp32 or (GW_OUT16) of
 * the operands' type. */
#pragma once
#include <stdint.h>

/* problems a launch with SwiGLU in the epilogue or a second product (their second maps at
 * i + GW_SW of the launch's arrays) */
#define GW_SW 32
#define GW_MAX 64  /* problems a launch: 27 KB of kernel parameters (CUDA >= 12.1) */
#define GW_OUT16 1 /* C holds 16-bit values */
#define GW_ACC 2   /* C += A B (C's values read) */

/* With k2 > 0 the problem is C (=, or += with GW_ACC) A B + A2 B2: A2 (m x k2) and B2
 * (k2 x n) laid out as A and B, with their strides; one sum over the k + k2 products, so
 * that C is written once. */
typedef struct {
    const uint16_t *a, *b, *a2, *b2;
    void *c;
    int m, n, k, k2, lda, ldb, ldc;
    int flags; /* GW_OUT16, GW_ACC */
} gw_problem;

typedef struct {
    int count; /* problems */
    gw_problem p[GW_MAX];
} gw_args;
