/* kernels/matmul.c: CPU reference of the linear layer (W (O,I), out = x W^T) and of the
 * grouped linear of the experts (rows offsets[g]..offsets[g+1] use weight g).
 *
 * Determinism: every output element is computed by one thread, in a fixed order, so the
 * bits do not depend on the thread count. The forward dot products use LANES partial
 * sums added in lane order (a fixed order that gcc vectorizes without -ffast-math);
 * dx and dw are sums of scaled rows (contiguous inner loops, no reduction to reorder):
 * dx in parallel over rows of x, dw over rows of dw, each summing n in increasing order. */
#include <string.h>

#include "kernels/ops.h"

#define LANES 16
/* Below this many multiply-adds a call stays on one thread (same bits either way). */
#define PAR_MIN_WORK 32768L

/* sum_i a[i] b[i] in a fixed order: LANES interleaved partial sums, then the tail. */
static inline real dot_lanes(const real *a, const real *b, int n)
{
    real acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += a[i + l] * b[i + l];
    real s = 0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

void matmul_forward(real *out, const real *x, const real *w, int N, int I, int O)
{
#pragma omp parallel for schedule(static) if ((long)N * I * O > PAR_MIN_WORK)
    for (int n = 0; n < N; n++) {
        const real *xr = x + (size_t)n * I;
        real *o = out + (size_t)n * O;
        for (int j = 0; j < O; j++)
            o[j] = dot_lanes(xr, w + (size_t)j * I, I);
    }
}

void matmul_forward_batch(real *out, size_t out_stride, const real *x, const real *w, int count,
                          int N, int I, int O)
{
    for (int c = 0; c < count; c++)
        matmul_forward(out + c * out_stride, x, w + (size_t)c * O * I, N, I, O);
}

void matmul_forward_add(real *out, const real *base, const real *x, const real *w, int N, int I,
                        int O)
{
#pragma omp parallel for schedule(static) if ((long)N * I * O > PAR_MIN_WORK)
    for (int n = 0; n < N; n++) {
        const real *xr = x + (size_t)n * I, *b = base + (size_t)n * O;
        real *o = out + (size_t)n * O;
        for (int j = 0; j < O; j++)
            o[j] = b[j] + dot_lanes(xr, w + (size_t)j * I, I);
    }
}

/* dx (N,I) += dout (N,O) W (O,I): row n of dx += sum_o dout[n,o] * W[o,:]. */
static void matmul_backward_dx(real *dx, const real *dout, const real *w, int N, int I, int O)
{
#pragma omp parallel for schedule(static) if ((long)N * I * O > PAR_MIN_WORK)
    for (int n = 0; n < N; n++) {
        real *dxr = dx + (size_t)n * I;
        const real *g = dout + (size_t)n * O;
        for (int o = 0; o < O; o++) {
            real a = g[o];
            const real *wr = w + (size_t)o * I;
            for (int i = 0; i < I; i++)
                dxr[i] += a * wr[i];
        }
    }
}

/* dw (O,I) += dout^T x: row o of dw += sum_n dout[n,o] * x[n,:]. */
static void matmul_backward_dw(real *dw, const real *dout, const real *x, int N, int I, int O)
{
#pragma omp parallel for schedule(static) if ((long)N * I * O > PAR_MIN_WORK)
    for (int o = 0; o < O; o++) {
        real *dwr = dw + (size_t)o * I;
        for (int n = 0; n < N; n++) {
            real a = dout[(size_t)n * O + o];
            const real *xr = x + (size_t)n * I;
            for (int i = 0; i < I; i++)
                dwr[i] += a * xr[i];
        }
    }
}

void matmul_backward(real *dx, real *dw, const real *dout, const real *x, const real *w, int N,
                     int I, int O, int write)
{
    if (dx && (write & MOE_WRITE_DX))
        memset(dx, 0, sizeof(real) * (size_t)N * I);
    if (dw && (write & MOE_WRITE_DW))
        memset(dw, 0, sizeof(real) * (size_t)O * I);
    if (dx)
        matmul_backward_dx(dx, dout, w, N, I, O);
    if (dw)
        matmul_backward_dw(dw, dout, x, N, I, O);
}

void grouped_matmul_forward(real *out, const real *x, const real *w, const int *offsets, int G,
                            int I, int O)
{
    for (int g = 0; g < G; g++) {
        int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows <= 0)
            continue;
        matmul_forward(out + (size_t)m0 * O, x + (size_t)m0 * I, w + (size_t)g * O * I, rows, I, O);
    }
}

void grouped_matmul_backward(real *dx, real *dw, const real *dout, const real *x, const real *w,
                             const int *offsets, int G, int I, int O, int write)
{
    if (dw && (write & MOE_WRITE_DW))
        memset(dw, 0, sizeof(real) * (size_t)G * O * I);
    if (dx && (write & MOE_WRITE_DX))
        memset(dx, 0, sizeof(real) * (size_t)offsets[G] * I);
    for (int g = 0; g < G; g++) {
        int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows <= 0)
            continue;
        matmul_backward(dx ? dx + (size_t)m0 * I : NULL, dw ? dw + (size_t)g * O * I : NULL,
                        dout + (size_t)m0 * O, x + (size_t)m0 * I, w + (size_t)g * O * I, rows, I,
                        O, 0);
    }
}

void grouped_matmul_forward_pair(real *out_a, real *out_b, const real *x, const real *wa,
                                 const real *wb, const int *offsets, int G, int I, int O)
{
    grouped_matmul_forward(out_a, x, wa, offsets, G, I, O);
    grouped_matmul_forward(out_b, x, wb, offsets, G, I, O);
}

void grouped_matmul_forward_pair_swiglu(real *h, real *out_a, real *out_b, const real *x,
                                        const real *wa, const real *wb, const int *offsets, int G,
                                        int I, int O)
{
    grouped_matmul_forward_pair(out_a, out_b, x, wa, wb, offsets, G, I, O);
    swiglu_forward(h, out_a, out_b, (size_t)offsets[G] * O);
}

void grouped_matmul_backward_pair(real *dx, real *dwa, real *dwb, const real *dout_a,
                                  const real *dout_b, const real *x, const real *wa, const real *wb,
                                  const int *offsets, int G, int I, int O, int write)
{
    grouped_matmul_backward(dx, dwa, dout_a, x, wa, offsets, G, I, O, write);
    grouped_matmul_backward(dx, dwb, dout_b, x, wb, offsets, G, I, O, write & ~MOE_WRITE_DX);
}
