/* kernels/cuda/router.cu: the MoE router in one kernel: softmax and top-k of the
 * logits and the auxiliary losses' partial sums (per chunk of MOE_AUX_CHUNK rows: one
 * block per chunk, one warp per row, each warp summing its rows into its own shared
 * accumulators, added over the warps in order: deterministic), their backward and
 * gradients. router_aux_partials copies the chunks back and adds them on the host (the
 * host waits for the stream). Sums in double as the CPU reference.
 * Top-k: the k-th choice is the best element after the (k-1)-th in the order
 * (probability decreasing, index increasing), i.e. ties go to the lower index, exactly
 * the reference's greedy choice. */
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

#define ROWS_PER_BLOCK (MOE_CUDA_THREADS / 32)
#define AUX_COLS_MAX 256 /* experts per launch of the aux backward (kernel parameter) */

/* a precedes b in the top-k order */
static __device__ __forceinline__ int precedes(float pa, int a, float pb, int b)
{
    return pa > pb || (pa == pb && a < b);
}

/* One row: softmax into p and lse, top-k into in and wn (lane 0 writes). */
static __device__ __forceinline__ void router_row(real *p, real *lse_n, int32_t *in, real *wn,
                                                  const real *l, int E, int K, int renorm, int lane)
{
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32)
        m = fmaxf(m, l[e]);
    m = moe_warp_max(m);
    double sum = 0.0;
    for (int e = lane; e < E; e += 32)
        sum += exp((double)l[e] - (double)m);
    sum = moe_warp_sum_d(sum);
    const double s = (double)m + log(sum);
    for (int e = lane; e < E; e += 32)
        p[e] = (real)exp((double)l[e] - s);
    if (lane == 0)
        *lse_n = (real)s;
    __syncwarp(); /* p is read back below */

    float prev_p = INFINITY;
    int prev = -1;
    double wsum = 0.0;
    for (int k = 0; k < K; k++) {
        float best_p = -INFINITY;
        int best = 0x7fffffff; /* none */
        for (int e = lane; e < E; e += 32) {
            float pe = p[e];
            if (pe != pe)
                pe = -INFINITY; /* NaN: last */
            if (precedes(prev_p, prev, pe, e) && precedes(pe, e, best_p, best)) {
                best_p = pe;
                best = e;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float op = __shfl_xor_sync(MOE_CUDA_FULL_MASK, best_p, o);
            const int oe = __shfl_xor_sync(MOE_CUDA_FULL_MASK, best, o);
            if (precedes(op, oe, best_p, best)) {
                best_p = op;
                best = oe;
            }
        }
        if (best >= E)
            best = 0; /* unreachable for K <= E; keeps the writes in bounds */
        const real pb = p[best];
        wsum += pb;
        if (lane == 0) {
            in[k] = best;
            wn[k] = pb;
        }
        prev_p = best_p;
        prev = best;
    }
    if (renorm) {
        __syncwarp(); /* lane 0 wrote wn */
        for (int k = lane; k < K; k += 32)
            wn[k] = (real)(wn[k] / wsum);
    }
    __syncwarp(); /* in, wn, p are read back by the partial sums */
}

/* Block = one chunk of MOE_AUX_CHUNK rows, warps rows warp, warp + W, ...; shared:
 * per warp E probability sums (double) and E counts (int), then the chunk's partials
 * (when part != NULL) as the warps' sums added in warp order. */
static __global__ void router_forward_kernel(real *probs, real *lse, int32_t *idx, real *w,
                                             double *part, const real *logits, int N, int E, int K,
                                             int renorm)
{
    extern __shared__ double rsm[];
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    double *wpsum = rsm + (size_t)warp * E, *wlse2 = rsm + (size_t)W * E;
    int *wcnt = (int *)(wlse2 + W) + (size_t)warp * E;
    if (part)
        for (int e = lane; e < E; e += 32) {
            wpsum[e] = 0.0;
            wcnt[e] = 0;
        }
    double lse2 = 0.0;
    const int lo = blockIdx.x * MOE_AUX_CHUNK, hi = min(N, lo + MOE_AUX_CHUNK);
    for (int n = lo + warp; n < hi; n += W) {
        real *p = probs + (size_t)n * E;
        int32_t *in = idx + (size_t)n * K;
        router_row(p, lse + n, in, w + (size_t)n * K, logits + (size_t)n * E, E, K, renorm, lane);
        if (!part)
            continue;
        for (int e = lane; e < E; e += 32)
            wpsum[e] += p[e];
        if (lane == 0) {
            for (int k = 0; k < K; k++)
                wcnt[in[k]]++;
            lse2 += (double)lse[n] * lse[n];
        }
    }
    if (!part)
        return;
    if (lane == 0)
        wlse2[warp] = lse2;
    __syncthreads();
    double *out = part + (size_t)blockIdx.x * (2 * (size_t)E + 1);
    const int *cnt0 = (const int *)(wlse2 + W);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double ps = 0.0;
        int c = 0;
        for (int v = 0; v < W; v++) {
            ps += rsm[(size_t)v * E + e];
            c += cnt0[(size_t)v * E + e];
        }
        out[e] = (double)c;
        out[E + e] = ps;
    }
    if (threadIdx.x == 0) {
        double q = 0.0;
        for (int v = 0; v < W; v++)
            q += wlse2[v];
        out[2 * E] = q;
    }
}

/* Warps per block: 8, fewer when the per-warp accumulators would pass 48 KB. */
static int router_warps(int E)
{
    int W = 8;
    while (W > 1 && (size_t)W * E * (sizeof(double) + sizeof(int)) + W * sizeof(double) > 49152)
        W >>= 1;
    return W;
}

extern "C" void cuda_router_forward(real *probs, real *lse, int32_t *idx, real *w, double *aux_part,
                                    const real *logits, int N, int E, int K, int renorm)
{
    if (N <= 0 || E <= 0)
        return;
    const int W = router_warps(E);
    const size_t smem =
        aux_part ? (size_t)W * E * (sizeof(double) + sizeof(int)) + W * sizeof(double) : 0;
    if (smem > 49152) {
        MOE_CUDA_FAIL("router: %d experts need %zu bytes of shared memory per block", E, smem);
        return;
    }
    MOE_CUDA_LAUNCH(router_forward_kernel, (N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK, 32 * W, smem,
                    probs, lse, idx, w, aux_part, logits, N, E, K, renorm);
}

/* One thread per row (K is small), the reference's loop. */
static __global__ void router_topk_backward_kernel(real *dprobs, const real *dw, const real *probs,
                                                   const int32_t *idx, int N, int E, int K,
                                                   int renorm)
{
    MOE_CUDA_GRID_STRIDE(n, N)
    {
        const int32_t *in = idx + n * K;
        const real *g = dw + n * K, *p = probs + n * E;
        real *dp = dprobs + n * E;
        if (!renorm) {
            for (int k = 0; k < K; k++)
                dp[in[k]] = __fadd_rn(dp[in[k]], g[k]);
            continue;
        }
        double S = 0.0, gw = 0.0;
        for (int k = 0; k < K; k++)
            S += p[in[k]];
        for (int k = 0; k < K; k++)
            gw += (double)g[k] * (p[in[k]] / S);
        for (int k = 0; k < K; k++)
            dp[in[k]] += (real)((g[k] - gw) / S);
    }
}

extern "C" void cuda_router_topk_backward(real *dprobs, const real *dw, const real *probs,
                                          const int32_t *idx, int N, int E, int K, int renorm)
{
    if (N <= 0 || K <= 0)
        return;
    MOE_CUDA_LAUNCH(router_topk_backward_kernel, moe_cuda_blocks(N, MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, dprobs, dw, probs, idx, N, E, K, renorm);
}

/* dlogits_e += p_e (dprobs_e - sum_j p_j dprobs_j). */
static __global__ void softmax_backward_kernel(real *dlogits, const real *dprobs, const real *probs,
                                               int N, int E)
{
    const int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N)
        return;
    const real *p = probs + (size_t)n * E, *g = dprobs + (size_t)n * E;
    real *dl = dlogits + (size_t)n * E;
    double dot = 0.0;
    for (int e = lane; e < E; e += 32)
        dot += (double)p[e] * g[e];
    dot = moe_warp_sum_d(dot);
    for (int e = lane; e < E; e += 32)
        dl[e] += (real)(p[e] * (g[e] - dot));
}

extern "C" void cuda_softmax_backward(real *dlogits, const real *dprobs, const real *probs, int N,
                                      int E)
{
    if (N <= 0 || E <= 0)
        return;
    MOE_CUDA_LAUNCH(softmax_backward_kernel, (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK,
                    MOE_CUDA_THREADS, 0, dlogits, dprobs, probs, N, E);
}

/* ---- auxiliary losses ---------------------------------------------------------------- */

extern "C" double cuda_router_aux_partials(int64_t *counts, double *psum, const double *aux_part,
                                           int N, int E)
{
    const size_t n = router_aux_part_len(N, E);
    if (n == 0 || E <= 0)
        return 0.0;
    const double *host = (const double *)moe_cuda_fetch(aux_part, sizeof(double) * n);
    return host ? router_aux_partials(counts, psum, host, N, E) : 0.0;
}

/* The aux term of dprobs is one constant per expert, computed on the host from the host
 * counts and passed by value, AUX_COLS_MAX experts per launch. */
typedef struct {
    float v[AUX_COLS_MAX];
} aux_cols;

/* The aux term of expert e's dprobs (Ng: the step's tokens, as a double). */
static real aux_col(double coef_aux, int E, int K, int64_t count, double ng)
{
    return (real)(coef_aux * E * (double)count / (ng * K) / ng);
}

static __global__ void aux_dprobs_kernel(real *dprobs, aux_cols c, int e0, int ncols, int N, int E)
{
    MOE_CUDA_GRID_STRIDE(i, (size_t)N * ncols)
    {
        const size_t n = i / ncols;
        const int j = (int)(i % ncols);
        real *d = dprobs + n * E + e0 + j;
        *d = __fadd_rn(*d, c.v[j]);
    }
}

static __global__ void aux_dlogits_kernel(real *dlogits, const real *probs, const real *lse,
                                          double coef_z, double ng, int N, int E)
{
    MOE_CUDA_GRID_STRIDE(i, (size_t)N * E)
    {
        const size_t n = i / E;
        const double c = coef_z * 2.0 * lse[n] / ng;
        dlogits[i] += (real)(c * probs[i]);
    }
}

extern "C" void cuda_router_aux_backward(real *dprobs, real *dlogits, const real *probs,
                                         const real *lse, const int64_t *counts, int64_t Ng, int N,
                                         int E, int K, double coef_aux, double coef_z)
{
    if (N <= 0 || E <= 0)
        return;
    const double ng = (double)Ng;
    if (dprobs)
        for (int e0 = 0; e0 < E; e0 += AUX_COLS_MAX) {
            const int ncols = E - e0 < AUX_COLS_MAX ? E - e0 : AUX_COLS_MAX;
            aux_cols c;
            for (int j = 0; j < ncols; j++)
                c.v[j] = aux_col(coef_aux, E, K, counts[e0 + j], ng);
            MOE_CUDA_LAUNCH(aux_dprobs_kernel, moe_cuda_blocks((size_t)N * ncols, MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, dprobs, c, e0, ncols, N, E);
        }
    if (dlogits)
        MOE_CUDA_LAUNCH(aux_dlogits_kernel, moe_cuda_blocks((size_t)N * E, MOE_CUDA_THREADS),
                        MOE_CUDA_THREADS, 0, dlogits, probs, lse, coef_z, ng, N, E);
}

/* ---- the router's backward in one kernel --------------------------------------------- */

/* Experts a row in one warp's registers (E / 32 a lane). */
#define FUSED_E_MAX AUX_COLS_MAX

/* One warp per row: dprobs (the top-k term, then the aux term) kept in registers, then
 * dlogits written: the z term, then the softmax backward added to it. Each value goes
 * through the same operations in the same order as router_topk_backward_kernel,
 * aux_dprobs_kernel, aux_dlogits_kernel and softmax_backward_kernel over zeroed dprobs
 * and dlogits: the same bits, in one pass instead of 4 kernels and 2 memsets. */
static __global__ void router_backward_kernel(real *dlogits, const real *dw, const real *probs,
                                              const int32_t *idx, const real *lse, aux_cols c,
                                              double coef_z, double ng, int N, int E, int K,
                                              int renorm)
{
    const int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N)
        return;
    const int32_t *in = idx + (size_t)n * K;
    const real *g = dw + (size_t)n * K, *p = probs + (size_t)n * E;
    real *dl = dlogits + (size_t)n * E;
    double S = 0.0, gw = 0.0;
    if (renorm) {
        for (int k = 0; k < K; k++)
            S += p[in[k]];
        for (int k = 0; k < K; k++)
            gw += (double)g[k] * (p[in[k]] / S);
    }
    real pv[FUSED_E_MAX / 32], dp[FUSED_E_MAX / 32];
    double dot = 0.0;
#pragma unroll
    for (int j = 0; j < FUSED_E_MAX / 32; j++) {
        const int e = lane + 32 * j;
        if (e < E) {
            real d = 0;
            for (int k = 0; k < K; k++)
                if (in[k] == e)
                    d = renorm ? d + (real)((g[k] - gw) / S) : __fadd_rn(d, g[k]);
            d = __fadd_rn(d, c.v[e]);
            pv[j] = p[e];
            dp[j] = d;
            dot += (double)pv[j] * d;
        }
    }
    dot = moe_warp_sum_d(dot);
    const double cz = coef_z * 2.0 * lse[n] / ng;
#pragma unroll
    for (int j = 0; j < FUSED_E_MAX / 32; j++) {
        const int e = lane + 32 * j;
        if (e < E) {
            const real t = (real)0 + (real)(cz * pv[j]);
            dl[e] = t + (real)(pv[j] * (dp[j] - dot));
        }
    }
}

extern "C" void cuda_router_backward(real *dlogits, real *dprobs, const real *dw, const real *probs,
                                     const int32_t *idx, const real *lse, const int64_t *counts,
                                     int64_t Ng, int N, int E, int K, int renorm, double coef_aux,
                                     double coef_z)
{
    if (N <= 0 || E <= 0)
        return;
    /* MOE_ROUTER_BACKWARD_UNFUSED=1: the 4 kernels (a benchmark knob, read each call: the
     * tests switch it); more experts than a warp's registers take: always */
    if (E > FUSED_E_MAX || moe_cuda_env_is("MOE_ROUTER_BACKWARD_UNFUSED", "1")) {
        const size_t bytes = sizeof(real) * (size_t)N * E;
        MOE_CUDA_OK(cudaMemsetAsync(dprobs, 0, bytes, moe_cuda_stream()));
        MOE_CUDA_OK(cudaMemsetAsync(dlogits, 0, bytes, moe_cuda_stream()));
        cuda_router_topk_backward(dprobs, dw, probs, idx, N, E, K, renorm);
        cuda_router_aux_backward(dprobs, dlogits, probs, lse, counts, Ng, N, E, K, coef_aux,
                                 coef_z);
        cuda_softmax_backward(dlogits, dprobs, probs, N, E);
        return;
    }
    const double ng = (double)Ng;
    aux_cols c;
    for (int e = 0; e < E; e++)
        c.v[e] = aux_col(coef_aux, E, K, counts[e], ng);
    MOE_CUDA_LAUNCH(router_backward_kernel, (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK,
                    MOE_CUDA_THREADS, 0, dlogits, dw, probs, idx, lse, c, coef_z, ng, N, E, K,
                    renorm);
}
