/* kernels/swiglu.c: CPU reference of the SwiGLU activation h = silu(a) * b, with
 * silu(a) = a * sigmoid(a). Elementwise; computed in double, stored as real. */
#include <math.h>

#include "kernels/ops.h"

static inline double sigmoid(double a) { return 1.0 / (1.0 + exp(-a)); }

void swiglu_forward(real *h, const real *a, const real *b, size_t n)
{
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) {
        double s = sigmoid(a[i]);
        h[i] = (real)(a[i] * s * b[i]);
    }
}

/* dh/da = b * s * (1 + a (1 - s)), dh/db = a * s; written over da and db. */
void swiglu_backward(real *da, real *db, const real *dh, const real *a, const real *b, size_t n)
{
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) {
        double s = sigmoid(a[i]);
        if (da)
            da[i] = (real)(dh[i] * (double)b[i] * s * (1.0 + a[i] * (1.0 - s)));
        if (db)
            db[i] = (real)(dh[i] * (double)a[i] * s);
    }
}
