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
 * + eps), with bc1 = 1 - beta1^t, bc2 = 1 - beta2^t: moe_adamw_elem (ops.h), the element
 * the CUDA kernels compute too. The moments are real (m16 0) or bf16 (m16 1): widened
 * before the element's step, rounded after. */
static void adamw_range(real *p, const real *g, void *m, void *v, int m16, size_t lo, size_t n,
                        real lr, real beta1, real beta2, real eps, real wd, real scale, int t)
{
    const moe_adamw_consts c = moe_adamw_setup(lr, beta1, beta2, eps, t);
    const real decay = moe_adamw_decay(&c, wd);
    real *mr = m, *vr = v;
    uint16_t *mh = m, *vh = v;
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = lo; i < lo + n; i++) {
        if (m16) {
            real mi = moe_bf16_widen(mh[i]), vi = moe_bf16_widen(vh[i]);
            p[i] = moe_adamw_elem(p[i], g[i], &mi, &vi, decay, scale, &c);
            mh[i] = moe_bf16_round((float)mi);
            vh[i] = moe_bf16_round((float)vi);
        } else {
            p[i] = moe_adamw_elem(p[i], g[i], &mr[i], &vr[i], decay, scale, &c);
        }
    }
}

void adamw_update(real *p, const real *g, real *m, real *v, size_t n, real lr, real beta1,
                  real beta2, real eps, real wd, int t)
{
    adamw_range(p, g, m, v, 0, 0, n, lr, beta1, beta2, eps, wd, 1, t);
}

void adamw_update_multi(real *p, const real *g, void *m, void *v, int moments16, size_t n,
                        size_t lo, size_t hi, const int64_t *offsets, const real *wd, int n_segs,
                        real lr, real beta1, real beta2, real eps, const double *norm_sq,
                        double clip, double loss_scale, int t, double *sq_out, size_t n_split)
{
    const double grad_scale =
        norm_sq ? moe_adamw_factor(norm_sq, clip, loss_scale) : (double)(float)(1.0 / loss_scale);
    hi = hi < n ? hi : n;
    lo = lo < hi ? lo : hi;
    if (sq_out) {
        const size_t split = n_split < lo ? lo : n_split < hi ? n_split : hi;
        sq_out[0] = grad_scale < 0 ? 0.0 : sum_squares(g + lo, split - lo);
        sq_out[1] = grad_scale < 0 ? 0.0 : sum_squares(g + split, hi - split);
    }
    if (grad_scale < 0) /* a gradient is not finite: the step is skipped */
        return;
    for (int s = 0; s < n_segs; s++) { /* segment s's part of [lo, hi) */
        const size_t a = (size_t)offsets[s] > lo ? (size_t)offsets[s] : lo;
        const size_t b = (size_t)offsets[s + 1] < hi ? (size_t)offsets[s + 1] : hi;
        if (a < b)
            adamw_range(p, g, m, v, moments16, a, b - a, lr, beta1, beta2, eps, wd[s],
                        (real)grad_scale, t);
    }
}
