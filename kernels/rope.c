/* kernels/rope.c: CPU reference of rotary position embedding, half rotation as in
 * transformers' rotate_half (Llama, Mixtral): within each head the pairs are
 * (i, i + Hd/2), rotated by the angle t * theta^(-2i/Hd):
 *   x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin.
 * The backward applies the inverse (transposed) rotation, in place or (rope_backward_qkv)
 * into the rows of [dq | dk | dv] that the q, k, v projections' one GEMM reads. */
#include <math.h>
#include <string.h>

#include "kernels/ops.h"

void rope_tables(real *cos_t, real *sin_t, int T, int Hd, double theta)
{
    int half = Hd / 2;
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double freq = pow(theta, -2.0 * i / Hd);
            double ang = t * freq;
            cos_t[(size_t)t * half + i] = (real)cos(ang);
            sin_t[(size_t)t * half + i] = (real)sin(ang);
        }
}

/* Rotates every head of every row of x by +angle (dir = 1) or -angle (dir = -1) into y,
 * whose rows are ldy apart (y = x, ldy = H * Hd: in place). */
static void rope_rotate(real *y, size_t ldy, const real *x, const real *cos_t, const real *sin_t,
                        int B, int T, int H, int Hd, real dir)
{
    int half = Hd / 2;
    int rows = B * T;
#pragma omp parallel for schedule(static) if ((long)rows * H * Hd > 65536)
    for (int r = 0; r < rows; r++) {
        int t = r % T;
        const real *c = cos_t + (size_t)t * half;
        const real *s = sin_t + (size_t)t * half;
        for (int h = 0; h < H; h++) {
            const real *x1 = x + ((size_t)r * H + h) * Hd, *x2 = x1 + half;
            real *y1 = y + (size_t)r * ldy + (size_t)h * Hd, *y2 = y1 + half;
            for (int i = 0; i < half; i++) {
                real a = x1[i], b = x2[i], sn = dir * s[i];
                y1[i] = a * c[i] - b * sn;
                y2[i] = b * c[i] + a * sn;
            }
        }
    }
}

void rope_forward(real *x, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd)
{
    rope_rotate(x, (size_t)H * Hd, x, cos_t, sin_t, B, T, H, Hd, (real)1);
}

void rope_backward(real *dx, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd)
{
    rope_rotate(dx, (size_t)H * Hd, dx, cos_t, sin_t, B, T, H, Hd, (real)-1);
}

void rope_backward_qkv(real *dqkv, const real *dq, const real *dk, const real *dv,
                       const real *cos_t, const real *sin_t, int B, int T, int H, int Hd)
{
    const size_t D = (size_t)H * Hd, rows = (size_t)B * T;
    rope_rotate(dqkv, 3 * D, dq, cos_t, sin_t, B, T, H, Hd, (real)-1);
    rope_rotate(dqkv + D, 3 * D, dk, cos_t, sin_t, B, T, H, Hd, (real)-1);
    for (size_t r = 0; r < rows; r++)
        memcpy(dqkv + r * 3 * D + 2 * D, dv + r * D, sizeof(real) * D);
}
