/* kernels/embedding.c: CPU reference of the token embedding lookup and its scatter-add
 * backward. Owns nothing else (the output head is a plain matmul). */
#include <string.h>

#include "kernels/ops.h"

void embedding_forward(real *out, const int32_t *tokens, const real *table, int N, int D)
{
#pragma omp parallel for schedule(static) if ((long)N * D > 65536)
    for (int n = 0; n < N; n++)
        memcpy(out + (size_t)n * D, table + (size_t)tokens[n] * D, (size_t)D * sizeof(real));
}

/* Sequential over n: several tokens may share a row of dtable, and a fixed order keeps
 * the result independent of the thread count. */
void embedding_backward(real *dtable, const real *dout, const int32_t *tokens, int N, int D, int V)
{
    (void)V;
    for (int n = 0; n < N; n++) {
        real *drow = dtable + (size_t)tokens[n] * D;
        const real *g = dout + (size_t)n * D;
        for (int d = 0; d < D; d++)
            drow[d] += g[d];
    }
}
