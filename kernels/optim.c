/* kernels/optim.c: CPU reference of the optimizer's elementwise pieces: the sum of
 * squares for the global gradient norm (sequential, in double: a fixed order), scaling
 * for clipping, the finiteness check, and the AdamW step (in double per element). */
#include <math.h>

#include "kernels/ops.h"

double sum_values(const real *x, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i];
    return s;
}

double sum_squares(const real *x, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return s;
}

void sum_into(double *acc, const real *x, size_t n, int square)
{
    *acc += square ? sum_squares(x, n) : sum_values(x, n);
}

void scale_inplace(real *x, real s, size_t n)
{
#pragma omp parallel for schedule(static) if (n > 262144)
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

int all_finite(const real *x, size_t n)
{
    int ok = 1;
    for (size_t i = 0; i < n; i++)
        ok &= isfinite(x[i]) != 0;
    return ok;
}

/* As torch.optim.AdamW: p *= 1 - lr*wd; m, v updated; p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2)
 * + eps), with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t. */
/* Moment i of an arena of real (m16 0) or bf16 (m16 1) values, and its store: the bf16
 * one rounded from the real the real arena would hold. */
static real moment_load(const void *a, size_t i, int m16)
{
    return m16 ? (real)moe_bf16_widen(((const uint16_t *)a)[i]) : ((const real *)a)[i];
}

static void moment_store(void *a, size_t i, double x, int m16)
{
    if (m16)
        ((uint16_t *)a)[i] = moe_bf16_round((float)(real)x);
    else
        ((real *)a)[i] = (real)x;
}

/* AdamW over elements [lo, lo + n) with gradients scaled by `scale`. */
static void adamw_range(real *p, const real *g, void *m, void *v, int m16, size_t lo, size_t n,
                        real lr, real beta1, real beta2, real eps, real wd, double scale, int t)
{
    const double b1 = beta1, b2 = beta2;
    const double step = (double)lr / (1.0 - pow(b1, t));
    const double sqrt_bc2 = sqrt(1.0 - pow(b2, t));
    const double decay = 1.0 - (double)lr * wd;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = lo; i < lo + n; i++) {
        double gi = scale == 1.0 ? (double)g[i] : (double)g[i] * scale;
        double mi = b1 * moment_load(m, i, m16) + (1.0 - b1) * gi;
        double vi = b2 * moment_load(v, i, m16) + (1.0 - b2) * gi * gi;
        moment_store(m, i, mi, m16);
        moment_store(v, i, vi, m16);
        p[i] = (real)(p[i] * decay - step * mi / (sqrt(vi) / sqrt_bc2 + eps));
    }
}

void adamw_update(real *p, const real *g, real *m, real *v, size_t n, real lr, real beta1,
                  real beta2, real eps, real wd, int t)
{
    adamw_range(p, g, m, v, 0, 0, n, lr, beta1, beta2, eps, wd, 1.0, t);
}

void adamw_update_multi(real *p, const real *g, void *m, void *v, int moments16, size_t n,
                        const int64_t *offsets, const real *wd, int n_segs, real lr, real beta1,
                        real beta2, real eps, const double *norm_sq, double clip, double loss_scale,
                        int t)
{
    (void)n; /* = offsets[n_segs] */
    const double grad_scale = moe_adamw_factor(norm_sq, clip, loss_scale);
    if (grad_scale < 0) /* a gradient is not finite: the step is skipped */
        return;
    for (int s = 0; s < n_segs; s++) {
        size_t lo = (size_t)offsets[s], len = (size_t)(offsets[s + 1] - offsets[s]);
        adamw_range(p, g, m, v, moments16, lo, len, lr, beta1, beta2, eps, wd[s], grad_scale, t);
    }
}
