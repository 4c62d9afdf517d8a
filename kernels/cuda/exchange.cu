/* kernels/cuda/exchange.cu: packing and unpacking the rows that travel between ranks in
 * the MoE dispatch and combine (row layout in ops.h). moe_pack_dispatch flags each
 * (destination, token) pair, numbers the flagged pairs with a prefix sum in
 * (destination, token) order -- the reference's order -- fills the rows (the grid covers
 * the most rows there can be; the count stays on the device) and queues one copy of the
 * counts to the host: nothing waits, the caller reads them after fetch_wait; with them,
 * the inverse map token_rows. The gradient scatter gathers each token's rows through that
 * map (or, without it, sorts the rows by token) and adds them in row order
 * (deterministic). */
#include "kernels/cuda/cuda_common.cuh"

/* Is assignment a (kept) on destination p? */
static __device__ __forceinline__ int on_dest(const int32_t *idx, const int32_t *slot_row,
                                              const int32_t *expert_rank, int a, int p)
{
    return slot_row[a] >= 0 && expert_rank[idx[a]] == p;
}

/* flags[p*N + t] = 1 if token t sends a row to p; assign[p] += its kept slots there;
 * experts[p*El + local] += 1 per kept slot (when experts is not NULL). Integer atomics:
 * the counts do not depend on the order. */
static __global__ void dispatch_flags_kernel(int *flags, int *assign, int *experts,
                                             const int32_t *idx, const int32_t *slot_row,
                                             const int32_t *expert_rank,
                                             const int32_t *expert_local, int N, int K, int P,
                                             int El)
{
    MOE_CUDA_GRID_STRIDE(i, (size_t)P * N)
    {
        const int p = (int)(i / N), t = (int)(i % N);
        int hits = 0;
        for (int k = 0; k < K; k++) {
            const int a = t * K + k, here = on_dest(idx, slot_row, expert_rank, a, p);
            hits += here;
            if (here && experts)
                atomicAdd(&experts[(size_t)p * El + expert_local[idx[a]]], 1);
        }
        flags[i] = hits > 0;
        if (hits)
            atomicAdd(&assign[p], hits);
    }
}

/* res: send_rows (P), send_assign (P), rows in all; rowsrc[row] = p*N + t; token_rows
 * (when not NULL) [t*P + p] = the row of (p, t) or -1. */
static __global__ void dispatch_counts_kernel(int *res, int *rowsrc, int32_t *token_rows,
                                              const int *rowidx, const int *assign, int N, int P)
{
    MOE_CUDA_GRID_STRIDE(i, (size_t)P * N)
    {
        const int sent = rowidx[i + 1] != rowidx[i];
        if (sent)
            rowsrc[rowidx[i]] = (int)i;
        if (token_rows)
            token_rows[(i % N) * P + i / N] = sent ? rowidx[i] : -1;
        if (i < (size_t)P) {
            res[i] = rowidx[(i + 1) * N] - rowidx[i * N];
            res[P + i] = assign[i];
        }
        if (i == 0)
            res[2 * P] = rowidx[(size_t)P * N];
    }
}

static __global__ void dispatch_fill_kernel(char *rows, int32_t *send_token, const int *rowsrc,
                                            const real *x, const int32_t *idx, const real *w,
                                            const int32_t *slot_row, const int32_t *expert_rank,
                                            const int32_t *expert_local, const int *n_rows, int N,
                                            int D, int K, size_t row_bytes, int x16)
{
    const int W = D + 2 * K, n = *n_rows;
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    MOE_CUDA_GRID_STRIDE(e, (size_t)n * W)
    {
        const int r = (int)(e / W), j = (int)(e % W);
        const int src = rowsrc[r], p = src / N, t = src % N;
        char *row = rows + (size_t)r * row_bytes;
        real *wt = (real *)(row + tb);
        if (j == 0)
            send_token[r] = t;
        if (j < D) {
            const real v = x[(size_t)t * D + j];
            if (x16 == MOE_ROW_FP32)
                ((real *)row)[j] = v;
            else if (x16 == MOE_ROW_BF16)
                ((__nv_bfloat16 *)row)[j] = __float2bfloat16_rn(v);
            else
                ((__half *)row)[j] = __float2half_rn(v);
        } else if (j < D + K) {
            const int a = t * K + (j - D);
            wt[j - D] = on_dest(idx, slot_row, expert_rank, a, p) ? w[a] : (real)0;
        } else {
            const int a = t * K + (j - D - K);
            ((int32_t *)(wt + K))[j - D - K] =
                on_dest(idx, slot_row, expert_rank, a, p) ? expert_local[idx[a]] : -1;
        }
    }
}

extern "C" void cuda_moe_pack_dispatch(char *rows, int32_t *send_token, int32_t *token_rows,
                                       int *counts, const real *x, const int32_t *idx,
                                       const real *w, const int32_t *slot_row,
                                       const int32_t *expert_rank, const int32_t *expert_local,
                                       int N, int D, int K, int P, int El, size_t row_bytes,
                                       int x16)
{
    const size_t n_counts = (size_t)MOE_PACK_COUNTS(P, El);
    if (N <= 0 || P <= 0) {
        memset(counts, 0, sizeof(int) * n_counts);
        return;
    }
    const int PN = P * N;
    moe_cuda_carve c = {NULL, 0};
    int *rowidx = NULL, *scan = NULL, *assign = NULL, *res = NULL, *rowsrc = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !moe_cuda_carve_alloc(&c))
            return;
        rowidx = MOE_CUDA_TAKE(&c, int, PN + 1);
        scan = MOE_CUDA_TAKE(&c, int, moe_cuda_scan_ints(PN));
        assign = MOE_CUDA_TAKE(&c, int, P);
        res = MOE_CUDA_TAKE(&c, int, n_counts);
        rowsrc = MOE_CUDA_TAKE(&c, int, PN);
    }
    const unsigned blocks = moe_cuda_blocks(PN, MOE_CUDA_THREADS);
    int *experts = res + 2 * P + 1;
    MOE_CUDA_OK(cudaMemsetAsync(assign, 0, sizeof(int) * P, moe_cuda_stream()));
    if (El > 0)
        MOE_CUDA_OK(cudaMemsetAsync(experts, 0, sizeof(int) * (size_t)P * El, moe_cuda_stream()));
    MOE_CUDA_LAUNCH(dispatch_flags_kernel, blocks, MOE_CUDA_THREADS, 0, rowidx, assign,
                    El > 0 ? experts : NULL, idx, slot_row, expert_rank, expert_local, N, K, P, El);
    moe_cuda_scan(rowidx, rowidx, PN, scan);
    MOE_CUDA_LAUNCH(dispatch_counts_kernel, blocks, MOE_CUDA_THREADS, 0, res, rowsrc, token_rows,
                    rowidx, assign, N, P);
    /* the row count stays on the device: the fill covers the most rows there can be */
    MOE_CUDA_LAUNCH(dispatch_fill_kernel,
                    moe_cuda_blocks((size_t)PN * (D + 2 * K), MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    0, rows, send_token, rowsrc, x, idx, w, slot_row, expert_rank, expert_local,
                    res + 2 * P, N, D, K, row_bytes, x16);
    moe_cuda_fetch_async(counts, res, sizeof(int) * n_counts);
}

/* x (R,D), w (R,K), lidx (R,K) from the rows: one thread per value. */
static __global__ void unpack_kernel(real *x, real *w, int32_t *lidx, const char *rows, int R,
                                     int D, int K, size_t row_bytes, int x16)
{
    const int W = D + 2 * K;
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    MOE_CUDA_GRID_STRIDE(e, (size_t)R * W)
    {
        const int r = (int)(e / W), j = (int)(e % W);
        const char *row = rows + (size_t)r * row_bytes;
        const real *wt = (const real *)(row + tb);
        if (j < D)
            x[(size_t)r * D + j] = x16 == MOE_ROW_FP32 ? ((const real *)row)[j]
                                   : x16 == MOE_ROW_BF16
                                       ? __bfloat162float(((const __nv_bfloat16 *)row)[j])
                                       : __half2float(((const __half *)row)[j]);
        else if (j < D + K)
            w[(size_t)r * K + j - D] = wt[j - D];
        else
            lidx[(size_t)r * K + j - D - K] = ((const int32_t *)(wt + K))[j - D - K];
    }
}

extern "C" void cuda_moe_unpack_dispatch(real *x, real *w, int32_t *lidx, const char *rows, int R,
                                         int D, int K, size_t row_bytes, int x16)
{
    if (R <= 0 || D + 2 * K <= 0)
        return;
    MOE_CUDA_LAUNCH(unpack_kernel, moe_cuda_blocks((size_t)R * (D + 2 * K), MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, x, w, lidx, rows, R, D, K, row_bytes, x16);
}

static __global__ void pack_grad_kernel(real *rows, const real *dx, const real *dw, int R, int D,
                                        int K)
{
    const int W = D + K;
    MOE_CUDA_GRID_STRIDE(e, (size_t)R * W)
    {
        const size_t r = e / W;
        const int j = (int)(e % W);
        rows[e] = j < D ? dx[r * D + j] : dw[r * K + j - D];
    }
}

extern "C" void cuda_moe_pack_grad_rows(real *rows, const real *dx, const real *dw, int R, int D,
                                        int K)
{
    if (R <= 0 || D + K <= 0)
        return;
    MOE_CUDA_LAUNCH(pack_grad_kernel, moe_cuda_blocks((size_t)R * (D + K), MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, rows, dx, dw, R, D, K);
}

/* dx[token] += row[0..D), dw[token] += row[D..D+K), rows of a token in row order. */
struct scatter_grad {
    real *dx, *dw;
    const real *rows;
    int D, K;
    static constexpr bool vec4 = false; /* a row's columns go to two arrays */
    bool aligned16() const { return false; }
    __device__ float *dst(int t, int j) const
    {
        return j < D ? dx + (size_t)t * D + j : dw + (size_t)t * K + (j - D);
    }
    __device__ float load(int t, int j) const { return *dst(t, j); }
    __device__ float value(int r, int j) const { return rows[(size_t)r * (D + K) + j]; }
    __device__ void store(int t, int j, float v) const { *dst(t, j) = v; }
};

extern "C" void cuda_moe_scatter_grad_rows(real *dx, real *dw, const real *rows,
                                           const int32_t *send_token, int n, int D, int K,
                                           const int32_t *token_rows, int N, int P)
{
    scatter_grad op = {dx, dw, rows, D, K};
    moe_cuda_token_sums(op, send_token, n, D + K, token_rows, N, P);
}
