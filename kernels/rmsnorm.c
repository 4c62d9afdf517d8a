/* kernels/rmsnorm.c: CPU reference of RMSNorm, out = x / sqrt(mean(x^2) + eps) * weight.
 * Row sums are accumulated in double. Rows are independent, so the forward and dx run in
 * parallel over rows; dweight, a sum over rows, runs over blocks of columns, each summed
 * over rows in order, so its bits do not depend on the thread count. */
#include <math.h>
#include <string.h>

#include "kernels/ops.h"

#define RMS_COL_BLOCK 64

void rmsnorm_forward(real *out, real *rstd, const real *x, const real *weight, int N, int D,
                     real eps)
{
#pragma omp parallel for schedule(static) if ((long)N * D > 65536)
    for (int n = 0; n < N; n++) {
        const real *xr = x + (size_t)n * D;
        real *o = out + (size_t)n * D;
        double ss = 0.0;
        for (int d = 0; d < D; d++)
            ss += (double)xr[d] * xr[d];
        double r = 1.0 / sqrt(ss / D + (double)eps);
        for (int d = 0; d < D; d++)
            o[d] = (real)(xr[d] * r * weight[d]);
        rstd[n] = (real)r;
    }
}

/* dx_d = r * (w_d g_d - x_d * r^2 * sum_j(w_j g_j x_j) / D), r = rstd. */
static void rmsnorm_backward_dx(real *dx, const real *dout, const real *x, const real *weight,
                                const real *rstd, int N, int D, int write)
{
#pragma omp parallel for schedule(static) if ((long)N * D > 65536)
    for (int n = 0; n < N; n++) {
        const real *xr = x + (size_t)n * D;
        const real *g = dout + (size_t)n * D;
        real *dxr = dx + (size_t)n * D;
        double r = rstd[n];
        double dot = 0.0;
        for (int d = 0; d < D; d++)
            dot += (double)weight[d] * g[d] * xr[d];
        double c = r * r * dot / D;
        for (int d = 0; d < D; d++)
            dxr[d] = (real)(r * ((double)weight[d] * g[d] - xr[d] * c)) + (write ? 0 : dxr[d]);
    }
}

/* dweight_d = sum_n g_nd * x_nd * r_n, over a block of columns at a time. */
static void rmsnorm_backward_dweight(real *dweight, const real *dout, const real *x,
                                     const real *rstd, int N, int D, int write)
{
    int nblocks = (D + RMS_COL_BLOCK - 1) / RMS_COL_BLOCK;
#pragma omp parallel for schedule(static) if ((long)N * D > 65536)
    for (int b = 0; b < nblocks; b++) {
        int d0 = b * RMS_COL_BLOCK;
        int nd = D - d0 < RMS_COL_BLOCK ? D - d0 : RMS_COL_BLOCK;
        double acc[RMS_COL_BLOCK] = {0};
        for (int n = 0; n < N; n++) {
            const real *xr = x + (size_t)n * D + d0;
            const real *g = dout + (size_t)n * D + d0;
            double r = rstd[n];
            for (int j = 0; j < nd; j++)
                acc[j] += (double)g[j] * xr[j] * r;
        }
        for (int j = 0; j < nd; j++)
            dweight[d0 + j] = (real)acc[j] + (write ? 0 : dweight[d0 + j]);
    }
}

void rmsnorm_backward(real *dx, real *dweight, const real *dout, const real *x, const real *weight,
                      const real *rstd, int N, int D, int write, real *dx_op)
{
    if (dx)
        rmsnorm_backward_dx(dx, dout, x, weight, rstd, N, D, (write & MOE_WRITE_DX) != 0);
    if (dx && dx_op) /* no buffer holds 16-bit values here: the copy */
        memcpy(dx_op, dx, sizeof(real) * (size_t)N * D);
    if (dweight)
        rmsnorm_backward_dweight(dweight, dout, x, rstd, N, D, (write & MOE_WRITE_DW) != 0);
}
