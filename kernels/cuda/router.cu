/* kernels/cuda/router.cu: the MoE router: softmax and top-k of the logits, their
 * backward, and the auxiliary losses' partial sums (copied back to the host, which waits
 * for the stream) and gradients. One warp per row; sums in double as the CPU reference.
 * Top-k: the k-th choice is the best element after the (k-1)-th in the order
 * (probability decreasing, index increasing), i.e. ties go to the lower index, exactly
 * the reference's greedy choice. */
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

#define ROWS_PER_BLOCK (MOE_CUDA_THREADS / 32)
#define AUX_CHUNK 256    /* rows per partial sum of psum and lse^2 */
#define AUX_COLS_MAX 256 /* experts per launch of the aux backward (kernel parameter) */

/* a precedes b in the top-k order */
static __device__ __forceinline__ int precedes(float pa, int a, float pb, int b)
{
    return pa > pb || (pa == pb && a < b);
}

static __global__ void router_forward_kernel(real *probs, real *lse, int32_t *idx, real *w,
                                             const real *logits, int N, int E, int K, int renorm)
{
    const int n = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (n >= N)
        return; /* whole warp */
    const real *l = logits + (size_t)n * E;
    real *p = probs + (size_t)n * E;
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
        lse[n] = (real)s;
    __syncwarp(); /* p is read back below */

    int32_t *in = idx + (size_t)n * K;
    real *wn = w + (size_t)n * K;
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
}

extern "C" void cuda_router_forward(real *probs, real *lse, int32_t *idx, real *w,
                                    const real *logits, int N, int E, int K, int renorm)
{
    if (N <= 0 || E <= 0)
        return;
    MOE_CUDA_LAUNCH(router_forward_kernel, (N + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK,
                    MOE_CUDA_THREADS, 0, probs, lse, idx, w, logits, N, E, K, renorm);
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

static __global__ void aux_count_kernel(unsigned long long *cnt, const int32_t *idx, int NK, int E)
{
    MOE_CUDA_GRID_STRIDE(a, NK)
    {
        const int e = idx[a];
        if (e >= 0 && e < E)
            atomicAdd(&cnt[e], 1ull);
    }
}

/* Per chunk of AUX_CHUNK rows: psum_part[chunk][e] and lse2_part[chunk]. */
static __global__ void aux_partial_kernel(double *psum_part, double *lse2_part, const real *probs,
                                          const real *lse, int N, int E)
{
    const int chunk = blockIdx.x, lo = chunk * AUX_CHUNK, hi = min(N, lo + AUX_CHUNK);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double s = 0.0;
        for (int n = lo; n < hi; n++)
            s += probs[(size_t)n * E + e];
        psum_part[(size_t)chunk * E + e] = s;
    }
    double q = 0.0;
    for (int n = lo + threadIdx.x; n < hi; n += blockDim.x)
        q += (double)lse[n] * lse[n];
    q = moe_block_sum_d(q);
    if (threadIdx.x == 0)
        lse2_part[chunk] = q;
}

/* res: E counts (as unsigned long long), E psums, then the lse^2 sum. */
static __global__ void aux_final_kernel(unsigned long long *res, const unsigned long long *cnt,
                                        const double *psum_part, const double *lse2_part,
                                        int chunks, int E)
{
    double *psum = (double *)(res + E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        double s = 0.0;
        for (int c = 0; c < chunks; c++)
            s += psum_part[(size_t)c * E + e];
        psum[e] = s;
        res[e] = cnt[e];
    }
    double q = 0.0;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
        q += lse2_part[c];
    q = moe_block_sum_d(q);
    if (threadIdx.x == 0)
        psum[E] = q;
}

extern "C" double cuda_router_aux_partials(int64_t *counts, double *psum, const real *probs,
                                           const real *lse, const int32_t *idx, int N, int E, int K)
{
    if (N <= 0 || E <= 0)
        return 0.0;
    const int chunks = (N + AUX_CHUNK - 1) / AUX_CHUNK;
    moe_cuda_carve c = {NULL, 0};
    unsigned long long *cnt = NULL, *res = NULL;
    double *psum_part = NULL, *lse2_part = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !moe_cuda_carve_alloc(&c))
            return 0.0;
        cnt = MOE_CUDA_TAKE(&c, unsigned long long, E);
        res = MOE_CUDA_TAKE(&c, unsigned long long, 2 * (size_t)E + 1);
        psum_part = MOE_CUDA_TAKE(&c, double, (size_t)chunks *E);
        lse2_part = MOE_CUDA_TAKE(&c, double, chunks);
    }
    MOE_CUDA_OK(cudaMemsetAsync(cnt, 0, sizeof(unsigned long long) * E, moe_cuda_stream()));
    if (K > 0)
        MOE_CUDA_LAUNCH(aux_count_kernel, moe_cuda_blocks((size_t)N * K, MOE_CUDA_THREADS),
                        MOE_CUDA_THREADS, 0, cnt, idx, N * K, E);
    MOE_CUDA_LAUNCH(aux_partial_kernel, chunks, MOE_CUDA_THREADS, 0, psum_part, lse2_part, probs,
                    lse, N, E);
    MOE_CUDA_LAUNCH(aux_final_kernel, 1, MOE_CUDA_THREADS, 0, res, cnt, psum_part, lse2_part,
                    chunks, E);
    const unsigned long long *host =
        (const unsigned long long *)moe_cuda_fetch(res, sizeof(unsigned long long) * (2 * E + 1));
    if (!host)
        return 0.0;
    const double *hpsum = (const double *)(host + E);
    for (int e = 0; e < E; e++) {
        counts[e] += (int64_t)host[e];
        psum[e] += hpsum[e];
    }
    return hpsum[E];
}

/* The aux term of dprobs is one constant per expert, computed on the host from the host
 * counts and passed by value, AUX_COLS_MAX experts per launch. */
typedef struct {
    float v[AUX_COLS_MAX];
} aux_cols;

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
                c.v[j] = (real)(coef_aux * E * (double)counts[e0 + j] / (ng * K) / ng);
            MOE_CUDA_LAUNCH(aux_dprobs_kernel, moe_cuda_blocks((size_t)N * ncols, MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, dprobs, c, e0, ncols, N, E);
        }
    if (dlogits)
        MOE_CUDA_LAUNCH(aux_dlogits_kernel, moe_cuda_blocks((size_t)N * E, MOE_CUDA_THREADS),
                        MOE_CUDA_THREADS, 0, dlogits, probs, lse, coef_z, ng, N, E);
}
