/* kernels/route.c: the routing plan (which (token, slot) assignment goes to which row of
 * the experts' input, with per-group capacity drops), and the moves it drives: permute
 * (gather tokens into expert order) and combine (weighted scatter back), with their
 * backwards. Owns no exchange between ranks (the dispatcher does that).
 * An assignment a = n*K + k is token n's k-th choice; ordering by a is ordering by
 * (token, slot). */
#include <string.h>

#include "kernels/ops.h"

/* Assignment a loses to b when b has the higher weight, or the same weight and comes
 * first (lower token, then lower slot). */
static inline int beats(const real *w, int32_t b, int32_t a)
{
    return w[b] > w[a] || (w[b] == w[a] && b < a);
}

/* Counting sort of the assignments a0..a0+na-1 by expert, stable, into list; on return
 * ends[e] is one past the last entry of expert e (so expert e spans ends[e-1]..ends[e],
 * with ends[-1] taken as 0). ends: E+1 ints. */
static void sort_by_expert(int *list, int *ends, const int32_t *idx, int a0, int na, int E)
{
    memset(ends, 0, (size_t)(E + 1) * sizeof(int));
    for (int a = a0; a < a0 + na; a++)
        if (idx[a] >= 0) /* a negative expert id is "no assignment" */
            ends[idx[a] + 1]++;
    for (int e = 0; e < E; e++)
        ends[e + 1] += ends[e];
    for (int a = a0; a < a0 + na; a++)
        if (idx[a] >= 0)
            list[ends[idx[a]]++] = a;
}

/* Marks keep[a] = 1 for the assignments within capacity, 0 for the dropped ones, one
 * group of tokens at a time. An expert over capacity keeps the `capacity` assignments
 * that no more than capacity-1 others beat. O(c^2) in an expert's count c, only when c
 * exceeds the capacity. */
static void mark_capacity(int32_t *keep, int *scratch, int *ends, const int32_t *idx, const real *w,
                          int N, int E, int K, int group, int capacity)
{
    for (int t0 = 0; t0 < N; t0 += group) {
        int rows = N - t0 < group ? N - t0 : group;
        int a0 = t0 * K, na = rows * K;
        int *list = scratch + a0;
        for (int a = a0; a < a0 + na; a++)
            keep[a] = 0; /* slots without an expert stay dropped */
        sort_by_expert(list, ends, idx, a0, na, E);
        for (int e = 0; e < E; e++) {
            int lo = e ? ends[e - 1] : 0, hi = ends[e], c = hi - lo;
            for (int i = lo; i < hi; i++) {
                int rank = 0;
                if (c > capacity)
                    for (int j = lo; j < hi; j++)
                        rank += beats(w, list[j], list[i]);
                keep[list[i]] = rank < capacity;
            }
        }
    }
}

int moe_route_plan(int *offsets, int32_t *row_token, int32_t *row_slot, int32_t *slot_row,
                   int *scratch, const int32_t *idx, const real *w, int N, int E, int K, int group,
                   int capacity)
{
    int NK = N * K;
    const int report = offsets != NULL;
    if (!report)
        offsets = scratch + NK; /* the caller knows the counts (ops.h) */
    if (group <= 0)
        group = N > 0 ? N : 1; /* defensive: one group (the runtime passes N % group == 0) */
    /* slot_row holds the keep flags until the rows are known. */
    if (capacity < 0)
        for (int a = 0; a < NK; a++)
            slot_row[a] = idx[a] >= 0;
    else
        mark_capacity(slot_row, scratch, offsets, idx, w, N, E, K, group, capacity);

    /* offsets[e+1] = kept count of expert e, then prefix sums; offsets[e] is then used as
     * the cursor of expert e, and shifted back at the end. */
    memset(offsets, 0, (size_t)(E + 1) * sizeof(int));
    for (int a = 0; a < NK; a++)
        if (slot_row[a])
            offsets[idx[a] + 1]++;
    for (int e = 0; e < E; e++)
        offsets[e + 1] += offsets[e];
    int M = offsets[E];
    for (int a = 0; a < NK; a++) {
        if (!slot_row[a]) {
            slot_row[a] = -1;
            continue;
        }
        int r = offsets[idx[a]]++;
        row_token[r] = a / K;
        row_slot[r] = a % K;
        slot_row[a] = r;
    }
    for (int e = E; e > 0; e--)
        offsets[e] = offsets[e - 1];
    offsets[0] = 0;
    return report ? M : -1;
}

void moe_permute(real *out, const real *x, const int32_t *row_token, int M, int D)
{
#pragma omp parallel for schedule(static) if ((long)M * D > 65536)
    for (int m = 0; m < M; m++)
        memcpy(out + (size_t)m * D, x + (size_t)row_token[m] * D, (size_t)D * sizeof(real));
}

/* Sequential over rows: a token appears in up to K rows, summed in row order (the
 * reference needs no inverse map). */
void moe_rows_base(real *dx, const real *base, int n, int D)
{
    if (base == dx || n <= 0)
        return;
    if (base)
        memcpy(dx, base, sizeof(real) * (size_t)n * D);
    else
        memset(dx, 0, sizeof(real) * (size_t)n * D);
}

void moe_permute_backward(real *dx, const real *base, const real *dout, const int32_t *row_token,
                          int M, int D, const int32_t *slot_row, int N, int K, const real *last)
{
    (void)slot_row;
    (void)K;
    moe_rows_base(dx, base, N, D);
    for (int m = 0; m < M; m++) {
        real *d = dx + (size_t)row_token[m] * D;
        const real *g = dout + (size_t)m * D;
        for (int j = 0; j < D; j++)
            d[j] += g[j];
    }
    if (last)
        add_inplace(dx, last, (size_t)N * D);
}

/* Sequential over rows, like the permute backward. */
void moe_combine_forward(real *y, const real *base, const real *expert_out, const real *w,
                         const int32_t *row_token, const int32_t *row_slot, int M, int D, int K,
                         const int32_t *slot_row, int N)
{
    (void)slot_row;
    moe_rows_base(y, base, N, D);
    for (int m = 0; m < M; m++) {
        int n = row_token[m];
        real wk = w[(size_t)n * K + row_slot[m]];
        real *yr = y + (size_t)n * D;
        const real *e = expert_out + (size_t)m * D;
        for (int j = 0; j < D; j++)
            yr[j] += wk * e[j];
    }
}

/* Each (token, slot) owns at most one row, so rows run in parallel. */
void moe_combine_backward(real *dexpert_out, real *dw, const real *dy, const real *expert_out,
                          const real *w, const int32_t *row_token, const int32_t *row_slot, int M,
                          int D, int K)
{
#pragma omp parallel for schedule(static) if ((long)M * D > 65536)
    for (int m = 0; m < M; m++) {
        size_t a = (size_t)row_token[m] * K + row_slot[m];
        const real *g = dy + (size_t)row_token[m] * D;
        const real *e = expert_out + (size_t)m * D;
        if (dexpert_out) {
            real *de = dexpert_out + (size_t)m * D;
            for (int j = 0; j < D; j++)
                de[j] = w[a] * g[j];
        }
        if (dw) {
            double dot = 0.0;
            for (int j = 0; j < D; j++)
                dot += (double)g[j] * e[j];
            dw[a] += (real)dot;
        }
    }
}

/* The distinct ids >= 0 of a row, in first-seen order; returns how many. */
static int distinct_ids(const int32_t *row, int K, int32_t *set)
{
    int n = 0;
    for (int k = 0; k < K; k++) {
        int seen = row[k] < 0;
        for (int j = 0; j < n && !seen; j++)
            seen = set[j] == row[k];
        if (!seen)
            set[n++] = row[k];
    }
    return n;
}

void routing_stats_count(int64_t *tokens, int64_t *load, int64_t *coact, int64_t *trans,
                         const int32_t *idx, const int32_t *prev_idx, int N, int E, int K)
{
    int32_t set[MOE_ROUTE_STATS_MAX_K], prev[MOE_ROUTE_STATS_MAX_K];
    for (int n = 0; n < N; n++) {
        const int nx = distinct_ids(idx + (size_t)n * K, K, set);
        if (nx == 0)
            continue;
        (*tokens)++;
        for (int a = 0; a < nx; a++) {
            load[set[a]]++;
            for (int b = 0; b < nx; b++)
                if (b != a)
                    coact[(size_t)set[a] * E + set[b]]++;
        }
        if (!prev_idx)
            continue;
        const int ny = distinct_ids(prev_idx + (size_t)n * K, K, prev);
        for (int a = 0; a < ny; a++)
            for (int b = 0; b < nx; b++)
                trans[(size_t)prev[a] * E + set[b]]++;
    }
}
