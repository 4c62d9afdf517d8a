/* kernels/cuda/embedding.cu: the token embedding lookup and its backward. The backward
 * groups the token positions by token id (a stable radix sort) and adds each id's rows
 * in position order, as the CPU reference does: deterministic, bit-identical to it. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void embedding_forward_kernel(real *out, const int32_t *tokens, const real *table,
                                                int N, int D)
{
    MOE_CUDA_GRID_STRIDE(e, (size_t)N * D)
    {
        const size_t n = e / D, d = e % D;
        out[e] = table[(size_t)tokens[n] * D + d];
    }
}

extern "C" void cuda_embedding_forward(real *out, const int32_t *tokens, const real *table, int N,
                                       int D)
{
    if (N <= 0 || D <= 0)
        return;
    MOE_CUDA_LAUNCH(embedding_forward_kernel, moe_cuda_blocks((size_t)N * D, MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, out, tokens, table, N, D);
}

/* dtable[token] += dout[position], positions of one token in order. */
struct embedding_grad {
    real *dtable;
    const real *dout;
    int D;
    __device__ float load(int token, int j) const { return dtable[(size_t)token * D + j]; }
    __device__ float value(int n, int j) const { return dout[(size_t)n * D + j]; }
    __device__ void store(int token, int j, float v) const { dtable[(size_t)token * D + j] = v; }
};

extern "C" void cuda_embedding_backward(real *dtable, const real *dout, const int32_t *tokens,
                                        int N, int D)
{
    embedding_grad op = {dtable, dout, D};
    moe_cuda_runs(op, tokens, N, D);
}
