/* kernels/cuda/route.cu: the routing plan (assignments ordered stably by expert, then
 * token, then slot; per-group capacity drops) and the moves it drives: permute, its
 * backward, combine and its backward.
 *
 * The plan is two stable groupings (bucket.cu): with a capacity, assignments are grouped
 * by (token group, expert) and each one counts the members of its group that beat it
 * (higher weight, or same weight and lower index) -- the reference's rule, O(c^2) in an
 * expert's count c only when c exceeds the capacity; then the kept ones are grouped by
 * expert. offsets and M are copied back (the op waits for the stream).
 * Scatters with several sources per destination (permute backward, combine forward)
 * sort the rows by token and add each token's rows in row order: deterministic and
 * bit-identical to the reference. */
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"

/* b beats a: higher weight, or the same weight and first. */
static __device__ __forceinline__ int beats(const real *w, int b, int a)
{
    return w[b] > w[a] || (w[b] == w[a] && b < a);
}

/* key of an assignment for the capacity: group * E + expert, -1 for none */
static __global__ void capacity_keys_kernel(int32_t *keys, const int32_t *idx, int NK, int K, int E,
                                            int group)
{
    MOE_CUDA_GRID_STRIDE(a, NK)
    {
        const int e = idx[a];
        keys[a] = e >= 0 && e < E ? (int)(a / K / group) * E + e : -1;
    }
}

/* kept[a] = expert of a if the capacity keeps it, else -1. */
static __global__ void capacity_keep_kernel(int32_t *kept, const int32_t *keys, const int *order,
                                            const int *start, const int32_t *idx, const real *w,
                                            int NK, int capacity)
{
    MOE_CUDA_GRID_STRIDE(i, NK)
    {
        const int a = (int)i, key = keys[a];
        if (key < 0) {
            kept[a] = -1;
            continue;
        }
        const int lo = start[key], hi = start[key + 1];
        int keep = hi - lo <= capacity;
        if (!keep) {
            int rank = 0;
            for (int j = lo; j < hi && rank < capacity; j++)
                rank += beats(w, order[j], a);
            keep = rank < capacity;
        }
        kept[a] = keep ? idx[a] : -1;
    }
}

/* Rows in expert order: row r < M is assignment order[r]; slot_row = -1 for the rest. */
static __global__ void plan_rows_kernel(int32_t *row_token, int32_t *row_slot, int32_t *slot_row,
                                        const int *order, const int *start, const int32_t *kept,
                                        int NK, int K, int E)
{
    const int M = start[E];
    MOE_CUDA_GRID_STRIDE(i, NK)
    {
        const int r = (int)i;
        if (r < M) {
            const int a = order[r];
            row_token[r] = a / K;
            row_slot[r] = a % K;
            slot_row[a] = r;
        }
        const int e = kept[r];
        if (e < 0 || e >= E)
            slot_row[r] = -1;
    }
}

extern "C" int cuda_moe_route_plan(int *offsets, int32_t *row_token, int32_t *row_slot,
                                   int32_t *slot_row, int *scratch, const int32_t *idx,
                                   const real *w, int N, int E, int K, int group, int capacity)
{
    const int NK = N * K;
    if (offsets)
        memset(offsets, 0, sizeof(int) * (size_t)(E + 1));
    if (NK <= 0 || E <= 0)
        return offsets ? 0 : -1;
    if (group <= 0)
        group = N; /* as the reference: one group */
    const int groups = (N + group - 1) / group;
    const int use_capacity = capacity >= 0;
    moe_cuda_sort by_group, by_expert;
    int32_t *keys = NULL;
    moe_cuda_carve c = {NULL, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !moe_cuda_carve_alloc(&c))
            return 0;
        if (use_capacity) {
            keys = MOE_CUDA_TAKE(&c, int32_t, NK);
            moe_cuda_sort_take(&by_group, &c, NK, groups * E);
        }
        moe_cuda_sort_take(&by_expert, &c, NK, E);
    }
    /* the kept assignments' experts (-1 dropped): idx itself when dropless */
    const int32_t *kept = idx;
    if (use_capacity) {
        const unsigned blocks = moe_cuda_blocks(NK, MOE_CUDA_THREADS);
        MOE_CUDA_LAUNCH(capacity_keys_kernel, blocks, MOE_CUDA_THREADS, 0, keys, idx, NK, K, E,
                        group);
        moe_cuda_sort_run(&by_group, keys);
        MOE_CUDA_LAUNCH(capacity_keep_kernel, blocks, MOE_CUDA_THREADS, 0, scratch, keys,
                        by_group.order, by_group.start, idx, w, NK, capacity);
        kept = scratch;
    }
    moe_cuda_sort_run(&by_expert, kept);
    MOE_CUDA_LAUNCH(plan_rows_kernel, moe_cuda_blocks(NK, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                    row_token, row_slot, slot_row, by_expert.order, by_expert.start, kept, NK, K,
                    E);
    if (!offsets) /* the caller knows the counts: no copy back, no synchronisation */
        return -1;
    const int *host = (const int *)moe_cuda_fetch(by_expert.start, sizeof(int) * (size_t)(E + 1));
    if (!host)
        return 0;
    memcpy(offsets, host, sizeof(int) * (size_t)(E + 1));
    return offsets[E];
}

/* ---- permute and combine ------------------------------------------------------------- */

/* out row m = x row row_token[m], in groups of V columns; O16: out is marked as holding
 * its GEMM operand (the experts' input), so it gets the 16-bit values; IN16: x is marked
 * (the received rows, unpacked in their 16 bits) and read as such. */
template <int V, bool O16, bool IN16>
static __global__ void permute_kernel(real *out, const real *x, const int32_t *row_token, int M,
                                      int D, int bf16)
{
    const int G = D / V; /* groups per row */
    MOE_CUDA_GRID_STRIDE(e, (size_t)M * G)
    {
        const size_t m = e / G, d = (e % G) * V, at = (size_t)row_token[m] * D + d;
        const moe_fvec<V> v = moe_ld_v<V, IN16>(x, at, bf16);
        if (O16)
            moe_store16_v<V>((uint16_t *)out + m * D + d, v, bf16);
        else
            moe_store_v<V>(out + m * D + d, v);
    }
}

extern "C" void cuda_moe_permute(real *out, const real *x, const int32_t *row_token, int M, int D)
{
    if (M <= 0 || D <= 0)
        return;
    int bf16 = 0;
    const bool o16 = cuda_operand_in_place(out, (size_t)M * D, &bf16);
    /* x's rows: the permutation's sources, of at most as many rows as the plan's */
    const bool in16 = cuda_operand_in_place(x, (size_t)D, &bf16);
    const int v4 = D % 4 == 0 && moe_aligned16(out) && moe_aligned16(x);
    const size_t items = (size_t)M * (v4 ? D / 4 : D);
    const unsigned blocks = moe_cuda_blocks(items, MOE_CUDA_THREADS);
    moe_cuda_pick(
        [&](auto v4_, auto o16_, auto in16_) {
            constexpr int V = decltype(v4_)::value ? 4 : 1;
            constexpr bool O16 = decltype(o16_)::value, IN16 = decltype(in16_)::value;
            MOE_CUDA_LAUNCH((permute_kernel<V, O16, IN16>), blocks, MOE_CUDA_THREADS, 0, out, x,
                            row_token, M, D, bf16);
        },
        v4, o16, in16);
}

/* dx[token] = (base[token] + dout[row] ...) + last[token], rows of a token in row order
 * (last NULL: nothing added; the store adds it, so only a gather, which stores every
 * token once, takes it); any row of dout may be read (any_item: moe_runs_kernel loads
 * ahead of the keys). */
struct permute_grad {
    real *dx;
    const real *base, *dout;
    int D;
    const real *last;
    static constexpr bool vec4 = true, vec2 = false, weighted = false, any_item = true;
    bool aligned16() const
    {
        return moe_aligned16(dx) && moe_aligned16(dout) && (!base || moe_aligned16(base)) &&
               (!last || moe_aligned16(last));
    }
    void start(int N) const { moe_cuda_rows_base(dx, base, N, D); }
    __device__ float load(int n, int j) const { return moe_base_value(base, (size_t)n * D + j); }
    __device__ float value(int m, int j) const { return dout[(size_t)m * D + j]; }
    __device__ void store(int n, int j, float v) const
    {
        const size_t at = (size_t)n * D + j;
        dx[at] = last ? __fadd_rn(v, last[at]) : v;
    }
    __device__ float4 load4(int n, int j) const { return moe_base_value4(base, (size_t)n * D + j); }
    __device__ float4 value4(int m, int j) const
    {
        return *(const float4 *)(dout + (size_t)m * D + j);
    }
    __device__ void store4(int n, int j, float4 v) const
    {
        const size_t at = (size_t)n * D + j;
        if (last) {
            const float4 t = *(const float4 *)(last + at);
            v = make_float4(__fadd_rn(v.x, t.x), __fadd_rn(v.y, t.y), __fadd_rn(v.z, t.z),
                            __fadd_rn(v.w, t.w));
        }
        *(float4 *)(dx + at) = v;
    }
};

/* The embedding's backward: dtable[token] += dout[n] ..., n in order (the table's rows
 * are their own base), the tokens (below V) sorted by the radix passes V's bits need. */
void moe_cuda_embedding_grad(real *dtable, const real *dout, const int32_t *tokens, int N, int D,
                             int V)
{
    permute_grad op = {dtable, dtable, dout, D, NULL};
    moe_cuda_runs(op, tokens, N, D, V);
}

extern "C" void cuda_moe_permute_backward(real *dx, const real *base, const real *dout,
                                          const int32_t *row_token, int M, int D,
                                          const int32_t *slot_row, int N, int K, const real *last)
{
    if (moe_cuda_token_sums_gather(slot_row, K)) { /* every token stored once: last in the store */
        permute_grad op = {dx, base, dout, D, last};
        moe_cuda_token_sums(op, row_token, M, D, slot_row, N, K);
        return;
    }
    permute_grad op = {dx, base, dout, D, NULL}; /* the runs store tokens with rows only */
    moe_cuda_token_sums(op, row_token, M, D, slot_row, N, K);
    if (last && N > 0 && D > 0)
        cuda_add_inplace(dx, last, (size_t)N * D);
}

/* y[token] = base[token] + w[token, slot] * expert_out[row] ..., rows of a token in row
 * order; e16: expert_out holds 16-bit values (marked; bf16 by `bf16`). The gather reads
 * w by (token, slot) (weight; valuew, value4w), the sorted runs through the row. */
struct combine_sum {
    real *y;
    const real *base, *expert_out, *w;
    const int32_t *row_token, *row_slot;
    int D, K, e16, bf16;
    static constexpr bool vec4 = true, vec2 = false, weighted = true;
    bool aligned16() const
    {
        return moe_aligned16(y) && moe_aligned16(expert_out) && (!base || moe_aligned16(base));
    }
    void start(int N) const { moe_cuda_rows_base(y, base, N, D); }
    __device__ float load(int n, int j) const { return moe_base_value(base, (size_t)n * D + j); }
    __device__ float weight(int n, int k) const { return w[(size_t)n * K + k]; }
    __device__ float valuew(int m, int j, float wk) const
    {
        const size_t at = (size_t)m * D + j;
        return __fmul_rn(wk, e16 ? moe_ld<1>(expert_out, at, bf16) : expert_out[at]);
    }
    __device__ float value(int m, int j) const
    {
        return valuew(m, j, w[(size_t)row_token[m] * K + row_slot[m]]);
    }
    __device__ void store(int n, int j, float v) const { y[(size_t)n * D + j] = v; }
    __device__ float4 load4(int n, int j) const { return moe_base_value4(base, (size_t)n * D + j); }
    __device__ float4 value4w(int m, int j, float wk) const
    {
        const size_t at = (size_t)m * D + j;
        const float4 e = e16 ? moe_ld4<1>(expert_out, at, bf16) : moe_ld4<0>(expert_out, at, 0);
        return make_float4(__fmul_rn(wk, e.x), __fmul_rn(wk, e.y), __fmul_rn(wk, e.z),
                           __fmul_rn(wk, e.w));
    }
    __device__ float4 value4(int m, int j) const
    {
        return value4w(m, j, w[(size_t)row_token[m] * K + row_slot[m]]);
    }
    __device__ void store4(int n, int j, float4 v) const { *(float4 *)(y + (size_t)n * D + j) = v; }
};

extern "C" void cuda_moe_combine_forward(real *y, const real *base, const real *expert_out,
                                         const real *w, const int32_t *row_token,
                                         const int32_t *row_slot, int M, int D, int K,
                                         const int32_t *slot_row, int N)
{
    int bf16 = 0;
    const int e16 = cuda_operand_in_place(expert_out, (size_t)M * D, &bf16);
    combine_sum op = {y, base, expert_out, w, row_token, row_slot, D, K, e16, bf16};
    moe_cuda_token_sums(op, row_token, M, D, slot_row, N, K);
}

/* dexpert_out[row] = w * dy[token]: one thread per group of V elements of a row. O16:
 * dexpert_out is marked as holding its GEMM operand (the down projection's output
 * gradient), so it gets the 16-bit values. */
template <int V, bool O16>
static __global__ void combine_dexpert_kernel(real *dexpert_out, const real *dy, const real *w,
                                              const int32_t *row_token, const int32_t *row_slot,
                                              int M, int D, int K, int bf16)
{
    const int G = D / V;
    MOE_CUDA_GRID_STRIDE(e, (size_t)M * G)
    {
        const size_t m = e / G, d = (e % G) * V;
        const size_t n = row_token[m];
        const real wk = w[n * K + row_slot[m]];
        moe_fvec<V> g = moe_load_v<V>(dy + n * D + d);
#pragma unroll
        for (int k = 0; k < V; k++)
            g.v[k] = __fmul_rn(wk, g.v[k]);
        if (O16)
            moe_store16_v<V>((uint16_t *)dexpert_out + m * D + d, g, bf16);
        else
            moe_store_v<V>(dexpert_out + m * D + d, g);
    }
}

/* dw[token, slot] += <dy[token], expert_out[row]> in double: one warp per row (each
 * (token, slot) has at most one row, so no two warps write one dw); e16: expert_out holds
 * 16-bit values (bf16 by `bf16`). */
static __global__ void combine_dw_kernel(real *dw, const real *dy, const real *expert_out,
                                         const int32_t *row_token, const int32_t *row_slot, int M,
                                         int D, int K, int e16, int bf16)
{
    const int m = blockIdx.x * (MOE_CUDA_THREADS / 32) + (threadIdx.x >> 5),
              lane = threadIdx.x & 31;
    if (m >= M)
        return;
    const size_t n = row_token[m];
    const real *g = dy + n * D;
    const size_t e = (size_t)m * D;
    double dot = 0.0;
    for (int j = lane; j < D; j += 32)
        dot += (double)g[j] * (e16 ? moe_ld<1>(expert_out, e + j, bf16) : expert_out[e + j]);
    dot = moe_warp_sum_d(dot);
    if (lane == 0)
        dw[n * K + row_slot[m]] += (real)dot;
}

/* Both in one pass where D % 4 == 0 and the rows are aligned: one warp per row reads
 * dy[token] once for the product and the dot (4 elements a lane a step; O16 / E16:
 * dexpert_out written, expert_out read, in 16 bits). The same products; the dot's double
 * sum in another order than combine_dw_kernel's (the same float nearly always). */
#define CB_STEPS 4
template <bool O16, int E16>
static __global__ void
combine_backward_fused_kernel(real *dexpert_out, real *dw, const real *dy, const real *expert_out,
                              const real *w, const int32_t *row_token, const int32_t *row_slot,
                              int M, int D, int K, int bf16)
{
    const int m = blockIdx.x * (MOE_CUDA_THREADS / 32) + (threadIdx.x >> 5),
              lane = threadIdx.x & 31;
    if (m >= M)
        return;
    const size_t n = row_token[m], a = n * K + row_slot[m];
    const real wk = w[a];
    const real *g = dy + n * D;
    const size_t e = (size_t)m * D;
    double dot = 0.0;
    /* CB_STEPS steps' loads before their stores (which the compiler may not move loads
     * past: they might alias), so that several are in flight; the dot in step order */
    for (int j0 = 4 * lane; j0 < D; j0 += 128 * CB_STEPS) {
        moe_fvec<4> gv[CB_STEPS], ev[CB_STEPS];
#pragma unroll
        for (int u = 0; u < CB_STEPS; u++) {
            const int j = j0 + 128 * u;
            if (j < D) {
                gv[u] = moe_load_v<4>(g + j);
                ev[u] = moe_ld_v<4, E16>(expert_out, e + j, bf16);
            }
        }
#pragma unroll
        for (int u = 0; u < CB_STEPS; u++) {
            const int j = j0 + 128 * u;
            if (j >= D)
                break;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                dot += (double)gv[u].v[k] * ev[u].v[k];
                gv[u].v[k] = __fmul_rn(wk, gv[u].v[k]);
            }
            if (O16)
                moe_store16_v<4>((uint16_t *)dexpert_out + e + j, gv[u], bf16);
            else
                moe_store_v<4>(dexpert_out + e + j, gv[u]);
        }
    }
    dot = moe_warp_sum_d(dot);
    if (lane == 0)
        dw[a] += (real)dot;
}

extern "C" void cuda_moe_combine_backward(real *dexpert_out, real *dw, const real *dy,
                                          const real *expert_out, const real *w,
                                          const int32_t *row_token, const int32_t *row_slot, int M,
                                          int D, int K)
{
    if (M <= 0)
        return;
    if (dexpert_out && dw && D > 0 && D % 4 == 0 && moe_aligned16(dexpert_out) &&
        moe_aligned16(dy) && moe_aligned16(expert_out)) {
        int bf16 = 0; /* set by either mark: both are of the one 16-bit precision */
        const bool o16 = cuda_operand_in_place(dexpert_out, (size_t)M * D, &bf16);
        const int e16 = cuda_operand_in_place(expert_out, (size_t)M * D, &bf16);
        const unsigned blocks = (M + MOE_CUDA_THREADS / 32 - 1) / (MOE_CUDA_THREADS / 32);
#define COMBINE_FUSED(O16, E16)                                                                    \
    MOE_CUDA_LAUNCH((combine_backward_fused_kernel<O16, E16>), blocks, MOE_CUDA_THREADS, 0,        \
                    dexpert_out, dw, dy, expert_out, w, row_token, row_slot, M, D, K, bf16)
        MOE_CUDA_PICK2(o16, e16, COMBINE_FUSED, true, false, 1, 0);
#undef COMBINE_FUSED
        return;
    }
    if (dexpert_out && D > 0) {
        int bf16 = 0;
        const bool o16 = cuda_operand_in_place(dexpert_out, (size_t)M * D, &bf16);
        const int v4 = D % 4 == 0 && moe_aligned16(dexpert_out) && moe_aligned16(dy);
        const size_t items = (size_t)M * (v4 ? D / 4 : D);
#define COMBINE_DEXPERT(V, O16)                                                                    \
    MOE_CUDA_LAUNCH((combine_dexpert_kernel<V, O16>), moe_cuda_blocks(items, MOE_CUDA_THREADS),    \
                    MOE_CUDA_THREADS, 0, dexpert_out, dy, w, row_token, row_slot, M, D, K, bf16)
        MOE_CUDA_PICK2(v4, o16, COMBINE_DEXPERT, 4, 1, true, false);
#undef COMBINE_DEXPERT
    }
    if (dw) {
        int bf16 = 0;
        const int e16 = cuda_operand_in_place(expert_out, (size_t)M * D, &bf16);
        MOE_CUDA_LAUNCH(combine_dw_kernel,
                        (M + MOE_CUDA_THREADS / 32 - 1) / (MOE_CUDA_THREADS / 32), MOE_CUDA_THREADS,
                        0, dw, dy, expert_out, row_token, row_slot, M, D, K, e16, bf16);
    }
}

/* ---- routing statistics -------------------------------------------------------------- */

/* The distinct ids >= 0 of a row, in first-seen order (as the reference). */
static __device__ int distinct_row(const int32_t *row, int K, int32_t *set)
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

/* One thread per token; integer atomics, so the counts do not depend on the order. */
static __global__ void routing_stats_kernel(unsigned long long *tokens, unsigned long long *load,
                                            unsigned long long *coact, unsigned long long *trans,
                                            const int32_t *idx, const int32_t *prev_idx, int N,
                                            int E, int K)
{
    int32_t set[MOE_ROUTE_STATS_MAX_K], prev[MOE_ROUTE_STATS_MAX_K];
    MOE_CUDA_GRID_STRIDE(n, N)
    {
        const int nx = distinct_row(idx + (size_t)n * K, K, set);
        if (nx == 0)
            continue;
        atomicAdd(tokens, 1ull);
        for (int a = 0; a < nx; a++) {
            atomicAdd(&load[set[a]], 1ull);
            for (int b = 0; b < nx; b++)
                if (b != a)
                    atomicAdd(&coact[(size_t)set[a] * E + set[b]], 1ull);
        }
        if (!prev_idx)
            continue;
        const int ny = distinct_row(prev_idx + (size_t)n * K, K, prev);
        for (int a = 0; a < ny; a++)
            for (int b = 0; b < nx; b++)
                atomicAdd(&trans[(size_t)prev[a] * E + set[b]], 1ull);
    }
}

extern "C" void cuda_routing_stats_count(int64_t *tokens, int64_t *load, int64_t *coact,
                                         int64_t *trans, const int32_t *idx,
                                         const int32_t *prev_idx, int N, int E, int K)
{
    if (N <= 0 || K <= 0)
        return;
    if (K > MOE_ROUTE_STATS_MAX_K) {
        MOE_CUDA_FAIL("routing statistics: K = %d, at most %d", K, MOE_ROUTE_STATS_MAX_K);
        return;
    }
    MOE_CUDA_LAUNCH(routing_stats_kernel, moe_cuda_blocks(N, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                    (unsigned long long *)tokens, (unsigned long long *)load,
                    (unsigned long long *)coact, (unsigned long long *)trans, idx, prev_idx, N, E,
                    K);
}
