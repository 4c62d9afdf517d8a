/* kernels/cuda/loss.cu: token cross-entropy (lse of the logits minus the target's logit)
 * and its backward. Forward: one block per row, max in float, exponentials in float
 * (expf) summed in double with a fixed-order block reduction. Backward: one thread per
 * logit, expf. Within 1e-6 of the CPU reference (all in double); float exponentials keep
 * it memory-bound where the double rate is low (the T4). */
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
        sum += expf(l[v] - m);
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
    MOE_CUDA_LAUNCH(cross_entropy_forward_kernel, N, MOE_CUDA_THREADS, 0, losses, lse, logits,
                    targets, V);
}

/* dlogits += dloss * (exp(logit - lse) - onehot(target)). */
static __global__ void cross_entropy_backward_kernel(real *dlogits, const real *logits,
                                                     const real *lse, const int32_t *targets,
                                                     real dloss, int N, int V)
{
    MOE_CUDA_GRID_STRIDE(e, (size_t)N * V)
    {
        const size_t n = e / V;
        const int v = (int)(e % V);
        const float p = expf(logits[e] - lse[n]) - (float)(v == targets[n]);
        dlogits[e] += dloss * p;
    }
}

extern "C" void cuda_cross_entropy_backward(real *dlogits, const real *logits, const real *lse,
                                            const int32_t *targets, real dloss, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    MOE_CUDA_LAUNCH(cross_entropy_backward_kernel, moe_cuda_blocks((size_t)N * V, MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, dlogits, logits, lse, targets, dloss, N, V);
}
