/* kernels/cuda/loss.cu: token cross-entropy (lse of the logits minus the target's logit)
 * and its backward. Forward: one block per row, max in float, exponentials summed in
 * double with a fixed-order block reduction. Backward: one thread per logit. The
 * exponentials are in double in fp32 mode (as the CPU reference), in float in the 16-bit
 * modes (within 1e-6; memory-bound where double is slow, the T4). */
#include "kernels/cuda/cuda_common.cuh"

static __device__ float block_max(float v)
{
    __shared__ float part[MOE_CUDA_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = moe_warp_max(v);
    __syncthreads();
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    float m = part[0];
    for (int w = 1; w < MOE_CUDA_THREADS / 32; w++)
        m = fmaxf(m, part[w]);
    return m;
}

template <typename F>
static __global__ void cross_entropy_forward_kernel(real *losses, real *lse, const real *logits,
                                                    const int32_t *targets, int V)
{
    const int n = blockIdx.x;
    const real *l = logits + (size_t)n * V;
    float m = -INFINITY;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        m = fmaxf(m, l[v]);
    m = block_max(m);
    double sum = 0.0;
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        sum += exp((F)l[v] - (F)m);
    sum = moe_block_sum_d(sum);
    if (threadIdx.x == 0) {
        const double s = (double)m + log(sum);
        lse[n] = (real)s;
        losses[n] = (real)(s - l[targets[n]]);
    }
}

extern "C" void cuda_cross_entropy_forward(real *losses, real *lse, const real *logits,
                                           const int32_t *targets, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    if (cuda_gemm_precision() == MOE_PREC_FP32)
        MOE_CUDA_LAUNCH(cross_entropy_forward_kernel<double>, N, MOE_CUDA_THREADS, 0, losses, lse,
                        logits, targets, V);
    else
        MOE_CUDA_LAUNCH(cross_entropy_forward_kernel<float>, N, MOE_CUDA_THREADS, 0, losses, lse,
                        logits, targets, V);
}

/* dlogits += dloss * (exp(logit - lse) - onehot(target)). */
template <typename F>
static __global__ void cross_entropy_backward_kernel(real *dlogits, const real *logits,
                                                     const real *lse, const int32_t *targets,
                                                     real dloss, int N, int V)
{
    MOE_CUDA_GRID_STRIDE(e, (size_t)N * V)
    {
        const size_t n = e / V;
        const int v = (int)(e % V);
        const F p = exp((F)logits[e] - (F)lse[n]) - (F)(v == targets[n]);
        dlogits[e] += (real)(dloss * p);
    }
}

extern "C" void cuda_cross_entropy_backward(real *dlogits, const real *logits, const real *lse,
                                            const int32_t *targets, real dloss, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    const unsigned blocks = moe_cuda_blocks((size_t)N * V, MOE_CUDA_THREADS);
    if (cuda_gemm_precision() == MOE_PREC_FP32)
        MOE_CUDA_LAUNCH(cross_entropy_backward_kernel<double>, blocks, MOE_CUDA_THREADS, 0, dlogits,
                        logits, lse, targets, dloss, N, V);
    else
        MOE_CUDA_LAUNCH(cross_entropy_backward_kernel<float>, blocks, MOE_CUDA_THREADS, 0, dlogits,
                        logits, lse, targets, dloss, N, V);
}
