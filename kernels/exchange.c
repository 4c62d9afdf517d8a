/* kernels/exchange.c: packing and unpacking the rows that travel between ranks in the
 * MoE dispatch and combine (see ops.h for the row layout). Pure data movement. */
#include <string.h>

#include "kernels/ops.h"

void moe_pack_dispatch(char *rows, int32_t *send_token, int32_t *token_rows, int *counts,
                       const real *x, const int32_t *idx, const real *w, const int32_t *slot_row,
                       const int32_t *expert_rank, const int32_t *expert_local, int N, int D, int K,
                       int P, int El, size_t row_bytes)
{
    int n = 0;
    int *send_rows = counts, *send_assign = counts + P, *send_experts = counts + 2 * P + 1;
    memset(counts, 0, sizeof(int) * (size_t)MOE_PACK_COUNTS(P, El));
    for (int p = 0; p < P; p++) {
        for (int t = 0; t < N; t++) {
            real *row = (real *)(rows + (size_t)n * row_bytes);
            int32_t *lid = (int32_t *)(row + D + K);
            int hits = 0;
            for (int k = 0; k < K; k++) {
                int a = t * K + k, e = idx[a];
                int here = slot_row[a] >= 0 && expert_rank[e] == p;
                row[D + k] = here ? w[a] : 0;
                lid[k] = here ? expert_local[e] : -1;
                hits += here;
                if (here)
                    send_experts[(size_t)p * El + expert_local[e]]++;
            }
            if (token_rows)
                token_rows[(size_t)t * P + p] = hits ? n : -1;
            if (!hits)
                continue;
            memcpy(row, x + (size_t)t * D, sizeof(real) * (size_t)D);
            send_token[n++] = t;
            send_rows[p]++;
            send_assign[p] += hits;
        }
    }
    counts[2 * P] = n;
}

void moe_unpack_dispatch(real *x, real *w, int32_t *lidx, const char *rows, int R, int D, int K,
                         size_t row_bytes)
{
    for (int r = 0; r < R; r++) {
        const real *row = (const real *)(rows + (size_t)r * row_bytes);
        memcpy(x + (size_t)r * D, row, sizeof(real) * (size_t)D);
        memcpy(w + (size_t)r * K, row + D, sizeof(real) * (size_t)K);
        memcpy(lidx + (size_t)r * K, row + D + K, sizeof(int32_t) * (size_t)K);
    }
}

void moe_pack_grad_rows(real *rows, const real *dx, const real *dw, int R, int D, int K)
{
    for (int r = 0; r < R; r++) {
        memcpy(rows + (size_t)r * (D + K), dx + (size_t)r * D, sizeof(real) * (size_t)D);
        memcpy(rows + (size_t)r * (D + K) + D, dw + (size_t)r * K, sizeof(real) * (size_t)K);
    }
}

/* In row order: token_rows (the inverse map) is not needed. */
void moe_scatter_grad_rows(real *dx, real *dw, const real *rows, const int32_t *send_token, int n,
                           int D, int K, const int32_t *token_rows, int N, int P)
{
    (void)token_rows;
    (void)N;
    (void)P;
    for (int r = 0; r < n; r++) {
        const real *row = rows + (size_t)r * (D + K);
        real *x = dx + (size_t)send_token[r] * D, *g = dw + (size_t)send_token[r] * K;
        for (int i = 0; i < D; i++)
            x[i] += row[i];
        for (int k = 0; k < K; k++)
            g[k] += row[D + k];
    }
}
