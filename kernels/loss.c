/* kernels/loss.c: CPU reference of the token cross-entropy loss (per token: logsumexp of
 * the logits minus the target's logit) and its backward (which overwrites its output, and
 * may write it over the logits). Sums in double; rows in parallel. */
#include <math.h>

#include "kernels/ops.h"

static double logsumexp_row(const real *l, int V)
{
    double m = -INFINITY;
    for (int v = 0; v < V; v++)
        if (l[v] > m)
            m = l[v];
    double sum = 0.0;
    for (int v = 0; v < V; v++)
        sum += exp(l[v] - m);
    return m + log(sum);
}

void cross_entropy_forward(real *losses, real *lse, const real *logits, const int32_t *targets,
                           int N, int V)
{
#pragma omp parallel for schedule(static) if ((long)N * V > 65536)
    for (int n = 0; n < N; n++) {
        const real *l = logits + (size_t)n * V;
        double s = logsumexp_row(l, V);
        lse[n] = (real)s;
        losses[n] = (real)(s - l[targets[n]]);
    }
}

void cross_entropy_backward(real *dlogits, const real *logits, const real *lse,
                            const int32_t *targets, real dloss, int N, int V)
{
#pragma omp parallel for schedule(static) if ((long)N * V > 65536)
    for (int n = 0; n < N; n++) {
        const real *l = logits + (size_t)n * V;
        real *dl = dlogits + (size_t)n * V; /* may be l: each value is read, then written */
        double s = lse[n];
        for (int v = 0; v < V; v++) {
            double p = exp(l[v] - s) - (v == targets[n]);
            dl[v] = (real)(dloss * p);
        }
    }
}

void cross_entropy_fused(real *losses, real *lse, real *dlogits, const real *logits,
                         const int32_t *targets, real dloss, int N, int V)
{
    cross_entropy_forward(losses, lse, logits, targets, N, V);
    cross_entropy_backward(dlogits, logits, lse, targets, dloss, N, V);
}
