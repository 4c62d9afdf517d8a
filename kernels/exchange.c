/* kernels/exchange.c: packing and unpacking the rows that travel between ranks in the
 * MoE dispatch and combine (see ops.h for the row layout). Pure data movement. */
#include <string.h>

#include "kernels/ops.h"

void moe_pack_dispatch(char *rows, int32_t *send_token, int32_t *token_rows, int *counts,
                       const real *x, const int32_t *idx, const real *w, const int32_t *slot_row,
                       const int32_t *expert_rank, const int32_t *expert_local, int N, int D, int K,
                       int P, int El, size_t row_bytes, int x16)
{
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    int n = 0;
    int *send_rows = counts, *send_assign = counts + P, *send_experts = counts + 2 * P + 1;
    memset(counts, 0, sizeof(int) * (size_t)MOE_PACK_COUNTS(P, El));
    for (int p = 0; p < P; p++) {
        for (int t = 0; t < N; t++) {
            char *row = rows ? rows + (size_t)n * row_bytes : NULL; /* NULL: counts only */
            real *wt = row ? (real *)(row + tb) : NULL;
            int32_t *lid = row ? (int32_t *)(wt + K) : NULL;
            int hits = 0;
            for (int k = 0; k < K; k++) {
                int a = t * K + k, e = idx[a];
                int here = slot_row[a] >= 0 && expert_rank[e] == p;
                if (row) {
                    wt[k] = here ? w[a] : 0;
                    lid[k] = here ? expert_local[e] : -1;
                }
                hits += here;
                if (here)
                    send_experts[(size_t)p * El + expert_local[e]]++;
            }
            if (token_rows)
                token_rows[(size_t)t * P + p] = hits ? n : -1;
            if (!hits)
                continue;
            const real *xt = row ? x + (size_t)t * D : NULL;
            if (row && x16 == MOE_ROW_FP32)
                memcpy(row, xt, sizeof(real) * (size_t)D);
            else if (row)
                for (int j = 0; j < D; j++)
                    ((uint16_t *)row)[j] =
                        x16 == MOE_ROW_BF16 ? moe_bf16_round(xt[j]) : moe_fp16_round(xt[j]);
            send_token[n++] = t;
            send_rows[p]++;
            send_assign[p] += hits;
        }
    }
    counts[2 * P] = n;
}

/* xr (D) = a row's token, 16-bit values widened. */
static void row_token_widen(real *xr, const char *row, int D, int x16)
{
    if (x16 == MOE_ROW_FP32)
        memcpy(xr, row, sizeof(real) * (size_t)D);
    else
        for (int j = 0; j < D; j++)
            xr[j] = x16 == MOE_ROW_BF16 ? moe_bf16_widen(((const uint16_t *)row)[j])
                                        : moe_fp16_widen(((const uint16_t *)row)[j]);
}

void moe_unpack_dispatch(real *x, real *w, int32_t *lidx, const char *rows, int R, int D, int K,
                         size_t row_bytes, int x16)
{
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    for (int r = 0; r < R; r++) {
        const char *row = rows + (size_t)r * row_bytes;
        if (x)
            row_token_widen(x + (size_t)r * D, row, D, x16);
        memcpy(w + (size_t)r * K, row + tb, sizeof(real) * (size_t)K);
        memcpy(lidx + (size_t)r * K, row + tb + sizeof(real) * (size_t)K,
               sizeof(int32_t) * (size_t)K);
    }
}

void moe_permute_rows(real *out, const char *rows, size_t row_bytes, int x16,
                      const int32_t *row_token, int M, int D)
{
#pragma omp parallel for schedule(static) if ((long)M * D > 65536)
    for (int m = 0; m < M; m++)
        row_token_widen(out + (size_t)m * D, rows + (size_t)row_token[m] * row_bytes, D, x16);
}

/* Sequential over the expert rows, as moe_permute_backward. */
void moe_pack_grad_rows(real *rows, const real *dout, const int32_t *row_token, int M,
                        const int32_t *slot_row, const real *dw, int R, int D, int K)
{
    (void)slot_row;
    for (int r = 0; r < R; r++) {
        memset(rows + (size_t)r * (D + K), 0, sizeof(real) * (size_t)D);
        memcpy(rows + (size_t)r * (D + K) + D, dw + (size_t)r * K, sizeof(real) * (size_t)K);
    }
    for (int m = 0; m < M; m++) {
        real *d = rows + (size_t)row_token[m] * (D + K);
        const real *g = dout + (size_t)m * D;
        for (int j = 0; j < D; j++)
            d[j] += g[j];
    }
}

/* In row order: token_rows (the inverse map) is not needed. */
void moe_scatter_grad_rows(real *dx, real *dw, const real *base, const real *rows,
                           const int32_t *send_token, int n, int D, int K,
                           const int32_t *token_rows, int N, int P)
{
    (void)token_rows;
    (void)P;
    moe_rows_base(dx, base, N, D);
    if (N > 0)
        memset(dw, 0, sizeof(real) * (size_t)N * K);
    for (int r = 0; r < n; r++) {
        const real *row = rows + (size_t)r * (D + K);
        real *x = dx + (size_t)send_token[r] * D, *g = dw + (size_t)send_token[r] * K;
        for (int i = 0; i < D; i++)
            x[i] += row[i];
        for (int k = 0; k < K; k++)
            g[k] += row[D + k];
    }
}
