/* kernels/cuda/swiglu.cu: SwiGLU h = silu(a) * b, silu(a) = a * sigmoid(a), and its
 * backward. Elementwise in float (expf, a few roundings: within 1e-6 relative of the CPU
 * reference, which computes in double); float keeps it memory-bound on GPUs whose double
 * rate is 1/32 or 1/64 of float (the T4). */
#include "kernels/cuda/cuda_common.cuh"

static __device__ __forceinline__ float sigmoid_f(float a) { return 1.f / (1.f + expf(-a)); }

static __global__ void swiglu_forward_kernel(real *h, const real *a, const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const float x = a[i], s = sigmoid_f(x);
        h[i] = x * s * b[i];
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
        const float x = a[i], s = sigmoid_f(x), g = dh[i];
        if (da)
            da[i] += g * b[i] * s * (1.f + x * (1.f - s));
        if (db)
            db[i] += g * x * s;
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
