/* kernels/cuda/swiglu.cuh: SwiGLU's element function, shared by swiglu.cu's kernels and
 * the experts' grouped wgmma kernel, which computes h in the gate and up projections'
 * epilogue (sm90/grouped_wgmma.cu): one function, so both give the same bits. */
#pragma once

#include "kernels/cuda/cuda_common.cuh"

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
