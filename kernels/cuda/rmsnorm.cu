/* kernels/cuda/rmsnorm.cu: RMSNorm, out = x / sqrt(mean(x^2) + eps) * weight, and its
 * backward. One warp per row, sums in double as the CPU reference. dweight, a sum over
 * rows, is a deterministic two-stage reduction: per chunk of rows a partial column sum
 * (fixed order inside the block), then the chunks in order. No atomics. */
#include "kernels/cuda/cuda_common.cuh"

#define ROWS_PER_BLOCK (MOE_CUDA_THREADS / 32) /* one warp per row */
#define DW_CHUNK 256                           /* rows per partial sum of dweight */
#define DW_COLS 32
#define DW_LANES 8 /* threads per column in a block */

static __global__ void rmsnorm_forward_kernel(real *out, real *rstd, const real *x,
                                              const real *weight, int N, int D, real eps)
{
    const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N)
        return; /* the whole warp: no block-wide synchronisation below */
    const real *xr = x + (size_t)row * D;
    real *o = out + (size_t)row * D;
    double ss = 0.0;
    for (int d = lane; d < D; d += 32)
        ss += (double)xr[d] * xr[d];
    ss = moe_warp_sum_d(ss);
    const double r = 1.0 / sqrt(ss / D + (double)eps);
    for (int d = lane; d < D; d += 32)
        o[d] = (real)(xr[d] * r * weight[d]);
    if (lane == 0)
        rstd[row] = (real)r;
}

extern "C" void cuda_rmsnorm_forward(real *out, real *rstd, const real *x, const real *weight,
                                     int N, int D, real eps)
{
    if (N <= 0 || D <= 0)
        return;
    MOE_CUDA_LAUNCH(rmsnorm_forward_kernel, (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK,
                    MOE_CUDA_THREADS, 0, out, rstd, x, weight, N, D, eps);
}

/* dx_d += r * (w_d g_d - x_d * r^2 * sum_j(w_j g_j x_j) / D). */
static __global__ void rmsnorm_backward_dx_kernel(real *dx, const real *dout, const real *x,
                                                  const real *weight, const real *rstd, int N,
                                                  int D)
{
    const int row = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= N)
        return;
    const real *xr = x + (size_t)row * D, *g = dout + (size_t)row * D;
    real *dxr = dx + (size_t)row * D;
    const double r = rstd[row];
    double dot = 0.0;
    for (int d = lane; d < D; d += 32)
        dot += (double)weight[d] * g[d] * xr[d];
    dot = moe_warp_sum_d(dot);
    const double c = r * r * dot / D;
    for (int d = lane; d < D; d += 32)
        dxr[d] += (real)(r * ((double)weight[d] * g[d] - xr[d] * c));
}

/* part[chunk][d] = sum over the chunk's rows n of g_nd x_nd r_n: block (DW_COLS, DW_LANES),
 * each thread a strided subset of the rows, then the DW_LANES partials in order. */
static __global__ void rmsnorm_dweight_partial(double *part, const real *dout, const real *x,
                                               const real *rstd, int N, int D)
{
    __shared__ double acc[DW_LANES][DW_COLS];
    const int d = blockIdx.x * DW_COLS + threadIdx.x, chunk = blockIdx.y;
    const int lo = chunk * DW_CHUNK, hi = min(N, lo + DW_CHUNK);
    double s = 0.0;
    if (d < D)
        for (int n = lo + threadIdx.y; n < hi; n += DW_LANES)
            s += (double)dout[(size_t)n * D + d] * x[(size_t)n * D + d] * (double)rstd[n];
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && d < D) {
        double t = 0.0;
        for (int l = 0; l < DW_LANES; l++)
            t += acc[l][threadIdx.x];
        part[(size_t)chunk * D + d] = t;
    }
}

static __global__ void rmsnorm_dweight_final(real *dweight, const double *part, int chunks, int D)
{
    MOE_CUDA_GRID_STRIDE(d, D)
    {
        double s = 0.0;
        for (int c = 0; c < chunks; c++)
            s += part[(size_t)c * D + d];
        dweight[d] += (real)s;
    }
}

extern "C" void cuda_rmsnorm_backward(real *dx, real *dweight, const real *dout, const real *x,
                                      const real *weight, const real *rstd, int N, int D)
{
    if (N <= 0 || D <= 0)
        return;
    if (dx)
        MOE_CUDA_LAUNCH(rmsnorm_backward_dx_kernel, (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK,
                        MOE_CUDA_THREADS, 0, dx, dout, x, weight, rstd, N, D);
    if (!dweight)
        return;
    const int chunks = (N + DW_CHUNK - 1) / DW_CHUNK;
    double *part = (double *)moe_cuda_scratch(sizeof(double) * (size_t)chunks * D);
    if (!part)
        return;
    dim3 grid((D + DW_COLS - 1) / DW_COLS, chunks), block(DW_COLS, DW_LANES);
    MOE_CUDA_LAUNCH(rmsnorm_dweight_partial, grid, block, 0, part, dout, x, rstd, N, D);
    MOE_CUDA_LAUNCH(rmsnorm_dweight_final, moe_cuda_blocks(D, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    0, dweight, part, chunks, D);
}
