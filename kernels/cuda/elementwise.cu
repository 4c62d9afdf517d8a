/* kernels/cuda/elementwise.cu: the residual add, y += x. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void add_inplace_kernel(real *y, const real *x, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n) { y[i] = __fadd_rn(y[i], x[i]); }
}

extern "C" void cuda_add_inplace(real *y, const real *x, size_t n)
{
    if (n == 0)
        return;
    MOE_CUDA_LAUNCH(add_inplace_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                    y, x, n);
}
