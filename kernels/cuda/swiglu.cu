/* kernels/cuda/swiglu.cu: SwiGLU h = silu(a) * b, silu(a) = a * sigmoid(a), and its
 * backward. Elementwise; in fp32 mode in double like the CPU reference (so results match
 * it to the rounding of the final cast), in the 16-bit modes in float (expf, a few
 * roundings: within 1e-6 relative), which keeps it memory-bound where double is slow. */
#include "kernels/cuda/cuda_common.cuh"

/* F: float or double, the type of the arithmetic */
template <typename F> static __device__ __forceinline__ F sigmoid(F a)
{
    return F(1) / (F(1) + exp(-a)); /* exp(float) is expf */
}

template <typename F>
static __global__ void swiglu_forward_kernel(real *h, const real *a, const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const F x = a[i], s = sigmoid(x);
        h[i] = (real)(x * s * (F)b[i]);
    }
}

extern "C" void cuda_swiglu_forward(real *h, const real *a, const real *b, size_t n)
{
    if (n == 0)
        return;
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (cuda_gemm_precision() == MOE_PREC_FP32)
        MOE_CUDA_LAUNCH(swiglu_forward_kernel<double>, blocks, MOE_CUDA_THREADS, 0, h, a, b, n);
    else
        MOE_CUDA_LAUNCH(swiglu_forward_kernel<float>, blocks, MOE_CUDA_THREADS, 0, h, a, b, n);
}

/* da += dh * b * s * (1 + a (1 - s)), db += dh * a * s. */
template <typename F>
static __global__ void swiglu_backward_kernel(real *da, real *db, const real *dh, const real *a,
                                              const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const F x = a[i], s = sigmoid(x), g = dh[i];
        if (da)
            da[i] += (real)(g * (F)b[i] * s * (F(1) + x * (F(1) - s)));
        if (db)
            db[i] += (real)(g * x * s);
    }
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dh, const real *a,
                                     const real *b, size_t n)
{
    if (n == 0 || (!da && !db))
        return;
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (cuda_gemm_precision() == MOE_PREC_FP32)
        MOE_CUDA_LAUNCH(swiglu_backward_kernel<double>, blocks, MOE_CUDA_THREADS, 0, da, db, dh, a,
                        b, n);
    else
        MOE_CUDA_LAUNCH(swiglu_backward_kernel<float>, blocks, MOE_CUDA_THREADS, 0, da, db, dh, a,
                        b, n);
}
