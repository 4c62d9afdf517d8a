/* kernels/cuda/swiglu.cu: SwiGLU h = silu(a) * b, silu(a) = a * sigmoid(a), and its
 * backward. Elementwise; in fp32 mode in double like the CPU reference (so results match
 * it to the rounding of the final cast), in the 16-bit modes in float (expf, a few
 * roundings: within 1e-6 relative), which keeps it memory-bound where double is slow.
 * Where every pointer is 16-byte aligned and n % 4 == 0 (the runtime's buffers), a
 * thread moves 4 elements with float4 loads and stores; else one element per thread.
 * Both forms compute each element with the same functions, so their bits agree. */
#include "kernels/cuda/cuda_common.cuh"

static_assert(sizeof(real) == sizeof(float), "the float4 forms read real as float");

/* F: float or double, the type of the arithmetic */
template <typename F> static __device__ __forceinline__ F sigmoid(F a)
{
    return F(1) / (F(1) + exp(-a)); /* exp(float) is expf */
}

/* h of one element. */
template <typename F> static __device__ __forceinline__ real swiglu_h(real a, real b)
{
    const F x = a, s = sigmoid(x);
    return (real)(x * s * (F)b);
}

/* The increments of one element, from g = dh, x = a and s = sigmoid(x):
 * da += g * b * s * (1 + x (1 - s)), db += g * x * s. */
template <typename F> static __device__ __forceinline__ real da_term(F g, F x, F s, real b)
{
    return (real)(g * (F)b * s * (F(1) + x * (F(1) - s)));
}

template <typename F> static __device__ __forceinline__ real db_term(F g, F x, F s)
{
    return (real)(g * x * s);
}

template <typename F>
static __global__ void swiglu_forward_kernel(real *h, const real *a, const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n) { h[i] = swiglu_h<F>(a[i], b[i]); }
}

/* The same over n4 groups of 4 elements. */
template <typename F>
static __global__ void swiglu_forward4_kernel(float4 *h, const float4 *a, const float4 *b,
                                              size_t n4)
{
    MOE_CUDA_GRID_STRIDE(i, n4)
    {
        const float4 x = a[i], y = b[i];
        h[i] = make_float4(swiglu_h<F>(x.x, y.x), swiglu_h<F>(x.y, y.y), swiglu_h<F>(x.z, y.z),
                           swiglu_h<F>(x.w, y.w));
    }
}

extern "C" void cuda_swiglu_forward(real *h, const real *a, const real *b, size_t n)
{
    if (n == 0)
        return;
    const bool fp32 = cuda_gemm_precision() == MOE_PREC_FP32;
    if (n % 4 == 0 && moe_aligned16(h) && moe_aligned16(a) && moe_aligned16(b)) {
        const unsigned blocks = moe_cuda_blocks(n / 4, MOE_CUDA_THREADS);
        float4 *h4 = (float4 *)h;
        const float4 *a4 = (const float4 *)a, *b4 = (const float4 *)b;
        if (fp32)
            MOE_CUDA_LAUNCH(swiglu_forward4_kernel<double>, blocks, MOE_CUDA_THREADS, 0, h4, a4, b4,
                            n / 4);
        else
            MOE_CUDA_LAUNCH(swiglu_forward4_kernel<float>, blocks, MOE_CUDA_THREADS, 0, h4, a4, b4,
                            n / 4);
        return;
    }
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (fp32)
        MOE_CUDA_LAUNCH(swiglu_forward_kernel<double>, blocks, MOE_CUDA_THREADS, 0, h, a, b, n);
    else
        MOE_CUDA_LAUNCH(swiglu_forward_kernel<float>, blocks, MOE_CUDA_THREADS, 0, h, a, b, n);
}

/* da or db may be NULL (that gradient is not wanted); b is read only for da. Both are
 * overwritten (ops.h). */
template <typename F>
static __global__ void swiglu_backward_kernel(real *da, real *db, const real *dh, const real *a,
                                              const real *b, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const F x = a[i], s = sigmoid(x), g = dh[i];
        if (da)
            da[i] = da_term<F>(g, x, s, b[i]);
        if (db)
            db[i] = db_term<F>(g, x, s);
    }
}

/* The same over n4 groups of 4 elements. */
template <typename F>
static __global__ void swiglu_backward4_kernel(float4 *da, float4 *db, const float4 *dh,
                                               const float4 *a, const float4 *b, size_t n4)
{
    MOE_CUDA_GRID_STRIDE(i, n4)
    {
        const float4 a4 = a[i], g4 = dh[i];
        const F x[4] = {a4.x, a4.y, a4.z, a4.w}, g[4] = {g4.x, g4.y, g4.z, g4.w};
        const F s[4] = {sigmoid(x[0]), sigmoid(x[1]), sigmoid(x[2]), sigmoid(x[3])};
        if (da) {
            const float4 y = b[i];
            da[i] =
                make_float4(da_term<F>(g[0], x[0], s[0], y.x), da_term<F>(g[1], x[1], s[1], y.y),
                            da_term<F>(g[2], x[2], s[2], y.z), da_term<F>(g[3], x[3], s[3], y.w));
        }
        if (db)
            db[i] = make_float4(db_term<F>(g[0], x[0], s[0]), db_term<F>(g[1], x[1], s[1]),
                                db_term<F>(g[2], x[2], s[2]), db_term<F>(g[3], x[3], s[3]));
    }
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dh, const real *a,
                                     const real *b, size_t n)
{
    if (n == 0 || (!da && !db))
        return;
    const bool fp32 = cuda_gemm_precision() == MOE_PREC_FP32;
    if (n % 4 == 0 && moe_aligned16(da) && moe_aligned16(db) && moe_aligned16(dh) &&
        moe_aligned16(a) && moe_aligned16(b)) {
        const unsigned blocks = moe_cuda_blocks(n / 4, MOE_CUDA_THREADS);
        float4 *da4 = (float4 *)da, *db4 = (float4 *)db;
        const float4 *dh4 = (const float4 *)dh, *a4 = (const float4 *)a, *b4 = (const float4 *)b;
        if (fp32)
            MOE_CUDA_LAUNCH(swiglu_backward4_kernel<double>, blocks, MOE_CUDA_THREADS, 0, da4, db4,
                            dh4, a4, b4, n / 4);
        else
            MOE_CUDA_LAUNCH(swiglu_backward4_kernel<float>, blocks, MOE_CUDA_THREADS, 0, da4, db4,
                            dh4, a4, b4, n / 4);
        return;
    }
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (fp32)
        MOE_CUDA_LAUNCH(swiglu_backward_kernel<double>, blocks, MOE_CUDA_THREADS, 0, da, db, dh, a,
                        b, n);
    else
        MOE_CUDA_LAUNCH(swiglu_backward_kernel<float>, blocks, MOE_CUDA_THREADS, 0, da, db, dh, a,
                        b, n);
}
