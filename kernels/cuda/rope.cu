/* kernels/cuda/rope.cu: rotary position embedding (half rotation: pairs (i, i + Hd/2) of
 * each head rotate by t * theta^(-2i/Hd)), its tables and its in-place inverse for the
 * backward (in place, or into the rows of [dq | dk | dv] that one GEMM reads). Products and
 * sums are rounded as the CPU reference's (no contraction), so the rotation is
 * bit-identical to it. A buffer marked as 16-bit (q and k, which the
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

/* The sources of one launch (blockIdx.y: which): rope_backward_qkv's dq, dk, dv, or the
 * one buffer rotated in place. */
typedef struct {
    const real *x[3];
} rope_sources;

/* y1 = x1 c - x2 s', y2 = x2 c + x1 s' with s' = dir * s, for V consecutive pairs
 * (i .. i+V-1, i + Hd/2 .. i + Hd/2 + V-1) of one head: V = 4 reads them with float4
 * (x, cos_t and sin_t 16-byte aligned, Hd/2 % 4 == 0), V = 8 16 bytes of 16-bit x and y
 * (Hd/2 % 8 == 0), V = 1 one float each (moe_fvec, cuda_common.cuh). Source blockIdx.y (src.x) goes
 * to column blockIdx.y * H * Hd of y's rows (ldy apart); the last source is copied as it is when
 * copy_last (dv into [dq | dk | dv]). Block (tx, ty): R ty rows of x (B*T rows of H heads of Hd)
 * per block, R of them a thread (their loads issued before any store), tx threads over the H *
 * (Hd/2)/V groups of a row, so the only divisions are 32-bit ones per group. X16, Y16: x, y hold
 * 16-bit values (bf16 when bf16, else fp16); y may be x (in place). */
template <int V, int X16, int Y16, int R>
static __global__ void rope_rotate_kernel(real *y, size_t ldy, rope_sources src, int copy_last,
                                          const real *cos_t, const real *sin_t, int rows, int T,
                                          int H, int Hd, real dir, int bf16)
{
    const int half = Hd / 2, groups = half / V;
    const int row0 = blockIdx.x * blockDim.y * R + threadIdx.y;
    if (row0 >= rows)
        return;
    const real *x = src.x[blockIdx.y];
    const int copy = copy_last && blockIdx.y == gridDim.y - 1;
    for (int j = threadIdx.x; j < H * groups; j += blockDim.x) {
        const int head = j / groups, i = (j - head * groups) * V;
        moe_fvec<V> a[R], b[R], c[R], s[R];
        int row[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            row[r] = row0 + r * blockDim.y;
            if (row[r] < rows) {
                const size_t e1 = ((size_t)row[r] * H + head) * Hd + i;
                a[r] = moe_ld_v<V, X16>(x, e1, bf16);
                b[r] = moe_ld_v<V, X16>(x, e1 + half, bf16);
                if (!copy) {
                    const size_t tab = (size_t)(row[r] % T) * half + i;
                    c[r] = moe_load_v<V>(cos_t + tab);
                    s[r] = moe_load_v<V>(sin_t + tab);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (row[r] >= rows)
                continue;
            if (!copy) {
#pragma unroll
                for (int k = 0; k < V; k++) {
                    const real sn = dir * s[r].v[k], ak = a[r].v[k], bk = b[r].v[k];
                    a[r].v[k] = __fsub_rn(__fmul_rn(ak, c[r].v[k]), __fmul_rn(bk, sn));
                    b[r].v[k] = __fadd_rn(__fmul_rn(bk, c[r].v[k]), __fmul_rn(ak, sn));
                }
            }
            const size_t f1 =
                (size_t)row[r] * ldy + (size_t)blockIdx.y * H * Hd + (size_t)head * Hd + i;
            if constexpr (Y16) {
                moe_store16_v<V>((uint16_t *)y + f1, a[r], bf16);
                moe_store16_v<V>((uint16_t *)y + f1 + half, b[r], bf16);
            } else {
                moe_store_v<V>(y + f1, a[r]);
                moe_store_v<V>(y + f1 + half, b[r]);
            }
        }
    }
}

/* Rows a thread of rope_rotate_kernel takes: MOE_ROPE_ROWS (1, 2 or 4), read once; when
 * unset 1 for the 16-byte form (V = 8: moe-bench rope_qkv on an H200, bf16, 65.3 / 73.2 /
 * 98.7 us with 1 / 2 / 4, rope16 21.8 / 21.5 / 27.1 us), else 2 (V = 4: rope_qkv 80.3 /
 * 72.7 / 84.1 us). */
static int rope_rows(int V)
{
    static int r = -1;
    if (r < 0) {
        const char *e = getenv("MOE_ROPE_ROWS");
        const int v = e ? atoi(e) : 0;
        r = v == 1 || v == 2 || v == 4 ? v : 0;
    }
    return r ? r : V == 8 ? 1 : 2;
}

/* Whether 16-bit rotations take 8 pairs a thread (16-byte accesses): unless MOE_ROPE_VEC=4
 * (then 4, 8 bytes; a benchmark knob), read once. */
static int rope_vec8(void)
{
    static int v = -1;
    if (v < 0)
        v = !moe_cuda_env_is("MOE_ROPE_VEC", "4");
    return v;
}

template <int V, int X16, int Y16, int R>
static void rope_launch_r(real *y, size_t ldy, const rope_sources &src, int parts, int copy_last,
                          const real *cos_t, const real *sin_t, int rows, int T, int H, int Hd,
                          real dir, int bf16)
{
    const int per_row = H * (Hd / 2 / V); /* groups of a row */
    const int tx = per_row >= MOE_CUDA_THREADS ? MOE_CUDA_THREADS : (per_row + 31) / 32 * 32;
    const int ty = MOE_CUDA_THREADS / tx;
    MOE_CUDA_LAUNCH((rope_rotate_kernel<V, X16, Y16, R>),
                    dim3((rows + ty * R - 1) / (ty * R), parts), dim3(tx, ty), 0, y, ldy, src,
                    copy_last, cos_t, sin_t, rows, T, H, Hd, dir, bf16);
}

template <int V, int X16, int Y16>
static void rope_launch(real *y, size_t ldy, const rope_sources &src, int parts, int copy_last,
                        const real *cos_t, const real *sin_t, int rows, int T, int H, int Hd,
                        real dir, int bf16)
{
    const int r = rope_rows(V);
    if (r == 4)
        rope_launch_r<V, X16, Y16, 4>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd,
                                      dir, bf16);
    else if (r == 2)
        rope_launch_r<V, X16, Y16, 2>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd,
                                      dir, bf16);
    else
        rope_launch_r<V, X16, Y16, 1>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd,
                                      dir, bf16);
}

template <int V>
static void rope_launch_v(real *y, size_t ldy, const rope_sources &src, int parts, int copy_last,
                          const real *cos_t, const real *sin_t, int rows, int T, int H, int Hd,
                          real dir, int x16, int y16, int bf16)
{
    if (x16 && y16)
        rope_launch<V, 1, 1>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir,
                             bf16);
    else if (x16)
        rope_launch<V, 1, 0>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir,
                             bf16);
    else if (y16)
        rope_launch<V, 0, 1>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir,
                             bf16);
    else
        rope_launch<V, 0, 0>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir,
                             bf16);
}

/* parts sources (src) of B*T rows into the rows of y (ldy apart), each at its column
 * part * H * Hd; x16 / y16: whether the sources / y hold 16-bit values. */
static void rope_rotate(real *y, size_t ldy, const rope_sources &src, int parts, int copy_last,
                        const real *cos_t, const real *sin_t, int B, int T, int H, int Hd, real dir,
                        int x16, int y16, int bf16)
{
    const int rows = B * T, half = Hd / 2;
    if (rows <= 0 || H <= 0 || half <= 0)
        return;
    int v4 = half % 4 == 0 && moe_aligned16(y) && moe_aligned16(cos_t) && moe_aligned16(sin_t);
    for (int p = 0; p < parts; p++)
        v4 = v4 && moe_aligned16(src.x[p]);
    /* 16-bit in and out: 8 pairs a thread, 16-byte accesses (the rows' starts stay
     * 16-byte aligned: ldy and H * Hd multiples of 8) */
    if (v4 && x16 && y16 && half % 8 == 0 && ldy % 8 == 0 && rope_vec8())
        rope_launch<8, 1, 1>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir,
                             bf16);
    else if (v4)
        rope_launch_v<4>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir, x16, y16,
                         bf16);
    else
        rope_launch_v<1>(y, ldy, src, parts, copy_last, cos_t, sin_t, rows, T, H, Hd, dir, x16, y16,
                         bf16);
}

static void rope_in_place(real *x, const real *cos_t, const real *sin_t, int B, int T, int H,
                          int Hd, real dir)
{
    int bf16 = 0;
    const int x16 = cuda_operand_in_place(x, (size_t)B * T * H * Hd, &bf16);
    const rope_sources src = {{x, NULL, NULL}};
    rope_rotate(x, (size_t)H * Hd, src, 1, 0, cos_t, sin_t, B, T, H, Hd, dir, x16, x16, bf16);
}

extern "C" void cuda_rope_forward(real *x, const real *cos_t, const real *sin_t, int B, int T,
                                  int H, int Hd)
{
    rope_in_place(x, cos_t, sin_t, B, T, H, Hd, (real)1);
}

extern "C" void cuda_rope_backward(real *dx, const real *cos_t, const real *sin_t, int B, int T,
                                   int H, int Hd)
{
    rope_in_place(dx, cos_t, sin_t, B, T, H, Hd, (real)-1);
}

/* dq, dk, dv hold 16-bit values or fp32 alike (marked or not together); dqkv (marked) is
 * written in 16 bits, the GEMM's operand. */
extern "C" void cuda_rope_backward_qkv(real *dqkv, const real *dq, const real *dk, const real *dv,
                                       const real *cos_t, const real *sin_t, int B, int T, int H,
                                       int Hd)
{
    const size_t n = (size_t)B * T * H * Hd;
    int bf16 = 0, b2 = 0;
    const int x16 = cuda_operand_in_place(dq, n, &bf16);
    if (cuda_operand_in_place(dk, n, &b2) != x16 || cuda_operand_in_place(dv, n, &b2) != x16) {
        MOE_CUDA_FAIL("rope_backward_qkv: dq, dk and dv are not all held in the same precision");
        return;
    }
    const int y16 = cuda_operand_in_place(dqkv, 3 * n, &bf16);
    const rope_sources src = {{dq, dk, dv}};
    rope_rotate(dqkv, 3 * (size_t)H * Hd, src, 3, 1, cos_t, sin_t, B, T, H, Hd, (real)-1, x16, y16,
                bf16);
}
