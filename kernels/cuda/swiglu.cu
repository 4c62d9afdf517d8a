/* kernels/cuda/swiglu.cu: SwiGLU h = silu(a) * b, silu(a) = a * sigmoid(a), and its
 * backward. Elementwise, in double like the CPU reference (so results match it to the
 * rounding of the final cast). */
#include "kernels/cuda/cuda_common.cuh"

static __device__ __forceinline__ double sigmoid_d(double a) { return 1.0 / (1.0 + exp(-a)); }

static __global__ void swiglu_forward_kernel(real *h, const real *a, const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const double s = sigmoid_d(a[i]);
        h[i] = (real)(a[i] * s * b[i]);
    }
}

extern "C" void cuda_swiglu_forward(real *h, const real *a, const real *b, size_t n)
{
    if (n == 0)
        return;
    MOE_CUDA_LAUNCH(swiglu_forward_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    0, h, a, b, n);
}

/* da += dh * b * s * (1 + a (1 - s)), db += dh * a * s. */
static __global__ void swiglu_backward_kernel(real *da, real *db, const real *dh, const real *a,
                                              const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const double s = sigmoid_d(a[i]);
        if (da)
            da[i] += (real)(dh[i] * (double)b[i] * s * (1.0 + a[i] * (1.0 - s)));
        if (db)
            db[i] += (real)(dh[i] * (double)a[i] * s);
    }
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dh, const real *a,
                                     const real *b, size_t n)
{
    if (n == 0 || (!da && !db))
        return;
    MOE_CUDA_LAUNCH(swiglu_backward_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    0, da, db, dh, a, b, n);
}
