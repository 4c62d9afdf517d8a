/* kernels/router.c: CPU reference of the MoE router: softmax of the logits, top-k with
 * optional renormalisation, their backward, and the auxiliary (load-balance and z)
 * losses' partial sums (by router_forward, per chunk of MOE_AUX_CHUNK rows) and gradients.
 * Sums are in double; rows and chunks run in parallel, the sums inside a chunk run
 * sequentially over its rows and router_aux_partials adds the chunks in order. */
#include <math.h>
#include <string.h>

#include "kernels/ops.h"

/* probs = softmax(l), returns logsumexp(l). */
static double softmax_row(real *probs, const real *l, int E)
{
    double m = -INFINITY;
    for (int e = 0; e < E; e++)
        if (l[e] > m)
            m = l[e];
    double sum = 0.0;
    for (int e = 0; e < E; e++)
        sum += exp(l[e] - m);
    double lse = m + log(sum);
    for (int e = 0; e < E; e++)
        probs[e] = (real)exp(l[e] - lse);
    return lse;
}

static int topk_taken(const int32_t *idx, int k, int e)
{
    for (int j = 0; j < k; j++)
        if (idx[j] == e)
            return 1;
    return 0;
}

/* idx: the K largest probs, decreasing; a tie goes to the lower index (strict >). */
static void topk_row(int32_t *idx, real *w, const real *p, int E, int K, int renorm)
{
    double sum = 0.0;
    for (int k = 0; k < K; k++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (!topk_taken(idx, k, e) && (best < 0 || p[e] > p[best]))
                best = e;
        idx[k] = best;
        w[k] = p[best];
        sum += p[best];
    }
    if (renorm)
        for (int k = 0; k < K; k++)
            w[k] = (real)(w[k] / sum);
}

void router_forward(real *probs, real *lse, int32_t *idx, real *w, double *aux_part,
                    const real *logits, int N, int E, int K, int renorm)
{
#pragma omp parallel for schedule(static) if ((long)N * E > 65536)
    for (int n = 0; n < N; n++) {
        real *p = probs + (size_t)n * E;
        lse[n] = (real)softmax_row(p, logits + (size_t)n * E, E);
        topk_row(idx + (size_t)n * K, w + (size_t)n * K, p, E, K, renorm);
    }
    if (!aux_part)
        return;
    /* the aux partials, chunk by chunk, rows in order inside a chunk */
    const int chunks = (N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK;
#pragma omp parallel for schedule(static) if ((long)N * E > 65536)
    for (int c = 0; c < chunks; c++) {
        double *cnt = aux_part + (size_t)c * (2 * (size_t)E + 1), *psum = cnt + E;
        double lse2 = 0.0;
        for (int e = 0; e < 2 * E; e++)
            cnt[e] = 0.0;
        const int hi = N < (c + 1) * MOE_AUX_CHUNK ? N : (c + 1) * MOE_AUX_CHUNK;
        for (int n = c * MOE_AUX_CHUNK; n < hi; n++) {
            for (int k = 0; k < K; k++)
                cnt[idx[(size_t)n * K + k]] += 1.0;
            for (int e = 0; e < E; e++)
                psum[e] += probs[(size_t)n * E + e];
            lse2 += (double)lse[n] * lse[n];
        }
        psum[E] = lse2;
    }
}

/* Without renorm w_k = p[idx_k]; with renorm w_k = p[idx_k] / S, S = sum_k p[idx_k], so
 * dL/dp[idx_j] = (dw_j - sum_k dw_k w_k) / S. */
void router_topk_backward(real *dprobs, const real *dw, const real *probs, const int32_t *idx,
                          int N, int E, int K, int renorm)
{
#pragma omp parallel for schedule(static) if ((long)N * E > 65536)
    for (int n = 0; n < N; n++) {
        const int32_t *in = idx + (size_t)n * K;
        const real *g = dw + (size_t)n * K, *p = probs + (size_t)n * E;
        real *dp = dprobs + (size_t)n * E;
        if (!renorm) {
            for (int k = 0; k < K; k++)
                dp[in[k]] += g[k];
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

/* dlogits_e += p_e (dprobs_e - sum_j p_j dprobs_j). */
void softmax_backward(real *dlogits, const real *dprobs, const real *probs, int N, int E)
{
#pragma omp parallel for schedule(static) if ((long)N * E > 65536)
    for (int n = 0; n < N; n++) {
        const real *p = probs + (size_t)n * E, *g = dprobs + (size_t)n * E;
        real *dl = dlogits + (size_t)n * E;
        double dot = 0.0;
        for (int e = 0; e < E; e++)
            dot += (double)p[e] * g[e];
        for (int e = 0; e < E; e++)
            dl[e] += (real)(p[e] * (g[e] - dot));
    }
}

double router_aux_partials(int64_t *counts, double *psum, const double *aux_part, int N, int E)
{
    const int chunks = N > 0 ? (N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK : 0;
    double lse2 = 0.0;
    for (int c = 0; c < chunks; c++) {
        const double *cnt = aux_part + (size_t)c * (2 * (size_t)E + 1), *ps = cnt + E;
        for (int e = 0; e < E; e++) {
            counts[e] += (int64_t)cnt[e];
            psum[e] += ps[e];
        }
        lse2 += ps[E];
    }
    return lse2;
}

void router_aux_backward(real *dprobs, real *dlogits, const real *probs, const real *lse,
                         const int64_t *counts, int64_t Ng, int N, int E, int K, double coef_aux,
                         double coef_z)
{
    double ng = (double)Ng;
#pragma omp parallel for schedule(static) if ((long)N * E > 65536)
    for (int n = 0; n < N; n++) {
        if (dprobs) {
            real *dp = dprobs + (size_t)n * E;
            for (int e = 0; e < E; e++)
                dp[e] += (real)(coef_aux * E * (double)counts[e] / (ng * K) / ng);
        }
        if (dlogits) {
            const real *p = probs + (size_t)n * E;
            real *dl = dlogits + (size_t)n * E;
            double c = coef_z * 2.0 * lse[n] / ng;
            for (int e = 0; e < E; e++)
                dl[e] += (real)(c * p[e]);
        }
    }
}

void router_backward(real *dlogits, real *dprobs, const real *dw, const real *probs,
                     const int32_t *idx, const real *lse, const int64_t *counts, int64_t Ng, int N,
                     int E, int K, int renorm, double coef_aux, double coef_z)
{
    if (N <= 0 || E <= 0)
        return;
    memset(dprobs, 0, sizeof(real) * (size_t)N * E);
    memset(dlogits, 0, sizeof(real) * (size_t)N * E);
    router_topk_backward(dprobs, dw, probs, idx, N, E, K, renorm);
    router_aux_backward(dprobs, dlogits, probs, lse, counts, Ng, N, E, K, coef_aux, coef_z);
    softmax_backward(dlogits, dprobs, probs, N, E);
}
