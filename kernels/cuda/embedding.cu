/* kernels/cuda/embedding.cu: the token embedding lookup and its backward. A lookup is a
 * gather of table rows by token id and its backward a scatter-add by token id: exactly
 * moe_permute and its backward (route.cu), which group the positions by id (a stable radix
 * sort) and add each id's rows in position order, as the CPU reference does. */
#include "kernels/cuda/cuda_common.cuh"

extern "C" void cuda_embedding_forward(real *out, const int32_t *tokens, const real *table, int N,
                                       int D)
{
    cuda_moe_permute(out, table, tokens, N, D);
}

extern "C" void cuda_embedding_backward(real *dtable, const real *dout, const int32_t *tokens,
                                        int N, int D, int V)
{
    /* added to the table's gradient; no inverse: sorted (tokens below V: the radix sort's
     * passes for V's bits) */
    moe_cuda_embedding_grad(dtable, dout, tokens, N, D, V);
}
