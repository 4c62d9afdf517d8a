/* kernels/elementwise.c: CPU reference of the plain elementwise ops (residual add). */
#include "kernels/ops.h"

void add_inplace(real *y, const real *x, size_t n)
{
#pragma omp parallel for schedule(static) if (n > 262144)
    for (size_t i = 0; i < n; i++)
        y[i] += x[i];
}
