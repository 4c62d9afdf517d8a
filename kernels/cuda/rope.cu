/* kernels/cuda/rope.cu: rotary position embedding (half rotation: pairs (i, i + Hd/2) of
 * each head rotate by t * theta^(-2i/Hd)), its tables and its in-place inverse for the
 * backward. Products and sums are rounded as the CPU reference's (no contraction), so
 * the rotation is bit-identical to it. */
#include "kernels/cuda/cuda_common.cuh"

static __global__ void rope_tables_kernel(real *cos_t, real *sin_t, int T, int Hd, double theta)
{
    const int half = Hd / 2;
    MOE_CUDA_GRID_STRIDE(e, (size_t)T * half)
    {
        const int t = (int)(e / half), i = (int)(e % half);
        const double freq = pow(theta, -2.0 * i / Hd);
        const double ang = t * freq;
        cos_t[e] = (real)cos(ang);
        sin_t[e] = (real)sin(ang);
    }
}

extern "C" void cuda_rope_tables(real *cos_t, real *sin_t, int T, int Hd, double theta)
{
    if (T <= 0 || Hd / 2 <= 0)
        return;
    MOE_CUDA_LAUNCH(rope_tables_kernel, moe_cuda_blocks((size_t)T * (Hd / 2), MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, cos_t, sin_t, T, Hd, theta);
}

/* x1' = x1 c - x2 s', x2' = x2 c + x1 s' with s' = dir * s: one thread per pair. */
static __global__ void rope_rotate_kernel(real *x, const real *cos_t, const real *sin_t, int T,
                                          int H, int Hd, size_t pairs, real dir)
{
    const int half = Hd / 2;
    MOE_CUDA_GRID_STRIDE(e, pairs)
    {
        const size_t rh = e / half; /* row * H + head */
        const int i = (int)(e % half);
        const int t = (int)((rh / H) % T);
        real *x1 = x + rh * Hd + i, *x2 = x1 + half;
        const real c = cos_t[(size_t)t * half + i], sn = dir * sin_t[(size_t)t * half + i];
        const real a = *x1, b = *x2;
        *x1 = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, sn));
        *x2 = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, sn));
    }
}

static void rope_rotate(real *x, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd,
                        real dir)
{
    const size_t pairs = (size_t)B * T * H * (Hd / 2);
    if (pairs == 0)
        return;
    MOE_CUDA_LAUNCH(rope_rotate_kernel, moe_cuda_blocks(pairs, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                    0, x, cos_t, sin_t, T, H, Hd, pairs, dir);
}

extern "C" void cuda_rope_forward(real *x, const real *cos_t, const real *sin_t, int B, int T,
                                  int H, int Hd)
{
    rope_rotate(x, cos_t, sin_t, B, T, H, Hd, (real)1);
}

extern "C" void cuda_rope_backward(real *dx, const real *cos_t, const real *sin_t, int B, int T,
                                   int H, int Hd)
{
    rope_rotate(dx, cos_t, sin_t, B, T, H, Hd, (real)-1);
}
