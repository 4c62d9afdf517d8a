/* kernels/cuda/rope.cu: rotary position embedding (half rotation: pairs (i, i + Hd/2) of
 * each head rotate by t * theta^(-2i/Hd)), its tables and its in-place inverse for the
 * backward. Products and sums are rounded as the CPU reference's (no contraction), so
 * the rotation is bit-identical to it. A buffer marked as 16-bit (q and k, which the
 * GEMMs wrote so: backend.h attention_operands16) is rotated in 16 bits: each value
 * widened, rotated as the fp32 one, rounded back (bf16 or fp16). */
#include "kernels/cuda/cuda_common.cuh"

static_assert(sizeof(real) == sizeof(float), "the float4 form reads real as float");

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

/* x1' = x1 c - x2 s', x2' = x2 c + x1 s' with s' = dir * s, for V consecutive pairs
 * (i .. i+V-1, i + Hd/2 .. i + Hd/2 + V-1) of one head: V = 4 reads them with float4
 * (x, cos_t and sin_t 16-byte aligned, Hd/2 % 4 == 0), V = 1 one float each (moe_fvec,
 * cuda_common.cuh).
 * Block (tx, ty): ty rows of x (B*T rows of H heads of Hd) per block, tx threads over the
 * H * (Hd/2)/V groups of a row, so the only divisions are 32-bit ones per group.
 * X16: x holds 16-bit values (bf16 when bf16, else fp16). */
template <int V, int X16>
static __global__ void rope_rotate_kernel(real *x, const real *cos_t, const real *sin_t, int rows,
                                          int T, int H, int Hd, real dir, int bf16)
{
    const int half = Hd / 2, groups = half / V;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows)
        return;
    const int t = row % T;
    const real *ct = cos_t + (size_t)t * half, *st = sin_t + (size_t)t * half;
    for (int j = threadIdx.x; j < H * groups; j += blockDim.x) {
        const int head = j / groups, i = (j - head * groups) * V;
        const size_t e1 = ((size_t)row * H + head) * Hd + i, e2 = e1 + half;
        const moe_fvec<V> c = moe_load_v<V>(ct + i), s = moe_load_v<V>(st + i);
        moe_fvec<V> a = moe_ld_v<V, X16>(x, e1, bf16), b = moe_ld_v<V, X16>(x, e2, bf16);
#pragma unroll
        for (int k = 0; k < V; k++) {
            const real sn = dir * s.v[k], ak = a.v[k], bk = b.v[k];
            a.v[k] = __fsub_rn(__fmul_rn(ak, c.v[k]), __fmul_rn(bk, sn));
            b.v[k] = __fadd_rn(__fmul_rn(bk, c.v[k]), __fmul_rn(ak, sn));
        }
        if constexpr (X16) {
            moe_store16_v<V>((uint16_t *)x + e1, a, bf16);
            moe_store16_v<V>((uint16_t *)x + e2, b, bf16);
        } else {
            moe_store_v<V>(x + e1, a);
            moe_store_v<V>(x + e2, b);
        }
    }
}

template <int V>
static void rope_launch(real *x, const real *cos_t, const real *sin_t, int rows, int T, int H,
                        int Hd, real dir, int x16, int bf16)
{
    const int per_row = H * (Hd / 2 / V); /* groups of a row */
    const int tx = per_row >= MOE_CUDA_THREADS ? MOE_CUDA_THREADS : (per_row + 31) / 32 * 32;
    const int ty = MOE_CUDA_THREADS / tx;
    if (x16)
        MOE_CUDA_LAUNCH((rope_rotate_kernel<V, 1>), (rows + ty - 1) / ty, dim3(tx, ty), 0, x, cos_t,
                        sin_t, rows, T, H, Hd, dir, bf16);
    else
        MOE_CUDA_LAUNCH((rope_rotate_kernel<V, 0>), (rows + ty - 1) / ty, dim3(tx, ty), 0, x, cos_t,
                        sin_t, rows, T, H, Hd, dir, bf16);
}

static void rope_rotate(real *x, const real *cos_t, const real *sin_t, int B, int T, int H, int Hd,
                        real dir)
{
    const int rows = B * T, half = Hd / 2;
    if (rows <= 0 || H <= 0 || half <= 0)
        return;
    int bf16 = 0;
    const int x16 = cuda_operand_in_place(x, (size_t)rows * H * Hd, &bf16);
    if (half % 4 == 0 && moe_aligned16(x) && moe_aligned16(cos_t) && moe_aligned16(sin_t))
        rope_launch<4>(x, cos_t, sin_t, rows, T, H, Hd, dir, x16, bf16);
    else
        rope_launch<1>(x, cos_t, sin_t, rows, T, H, Hd, dir, x16, bf16);
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
