/* kernels/cuda/swiglu.cu: SwiGLU h = silu(a) * b, silu(a) = a * sigmoid(a), and its
 * backward. Elementwise; in fp32 mode in double like the CPU reference (so results match
 * it to the rounding of the final cast), in the 16-bit modes in float (expf, a few
 * roundings: within 1e-6 relative), which keeps it memory-bound where double is slow.
 * Where every pointer is 16-byte aligned and n % 4 == 0 (the runtime's buffers), a
 * thread moves 4 elements with float4 loads and stores; else one element per thread.
 * Both forms compute each element with the same functions, so their bits agree. An
 * output marked as holding its GEMM operand (backend.h mark_operand) gets the 16-bit value
 * instead, rounded as the GEMM would have rounded the fp32 one: the same operand bits
 * without the fp32 write and the rounding pass's read and write. */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/swiglu.cuh"

static_assert(sizeof(real) == sizeof(float), "the float4 forms read real as float");

/* The 16-bit format (1: bf16, 0: fp16) in a kernel of AB16: a constant where the inputs
 * are marked (AB16 1: fp16, 2: bf16), so that widening and rounding compile to one form
 * instead of both and a select; else the argument (an output alone may be marked). */
#define AB16_FORMAT(AB16, arg) ((AB16) ? (int)((AB16) == 2) : (arg))

/* The increments of one element, from g = dh, x = a and s = sigmoid(x):
 * da += g * b * s * (1 + x (1 - s)), db += g * x * s. */
template <typename F> static __device__ __forceinline__ real da_term(F g, F x, F s, real b)
{
    return (real)(g * (F)b * s * (F(1) + x * (F(1) - s)));
}

template <typename F> static __device__ __forceinline__ real db_term(F g, F x, F s)
{
    return (real)(g * x * s);
}

/* h16 (a buffer marked as holding its GEMM operand, in a 16-bit precision): h is written
 * there as 16 bits, the same value rounded as the GEMM would round the fp32 h; else h.
 * AB16: a and b are marked, 16-bit (the experts' gate and up outputs): 2 bf16, 1 fp16. */
template <typename F, int AB16>
static __global__ void swiglu_forward_kernel(real *h, uint16_t *h16, const void *a, const void *b,
                                             size_t n, int bf16_arg)
{
    const int bf16 = AB16_FORMAT(AB16, bf16_arg);
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const real v = swiglu_h<F>(moe_ld<AB16>(a, i, bf16), moe_ld<AB16>(b, i, bf16));
        if (h16)
            h16[i] = moe_round16(v, bf16);
        else
            h[i] = v;
    }
}

/* The same over n4 groups of 4 elements. */
template <typename F, int AB16>
static __global__ void swiglu_forward4_kernel(float4 *h, uint2 *h16, const void *a, const void *b,
                                              size_t n4, int bf16_arg)
{
    const int bf16 = AB16_FORMAT(AB16, bf16_arg);
    MOE_CUDA_GRID_STRIDE(i, n4)
    {
        const float4 x = moe_ld4<AB16>(a, 4 * i, bf16), y = moe_ld4<AB16>(b, 4 * i, bf16);
        const float4 v = make_float4(swiglu_h<F>(x.x, y.x), swiglu_h<F>(x.y, y.y),
                                     swiglu_h<F>(x.z, y.z), swiglu_h<F>(x.w, y.w));
        if (h16)
            h16[i] = moe_round16x4(v, bf16);
        else
            h[i] = v;
    }
}

/* 16-bit in and out, over n8 groups of 8 elements (16-byte accesses): a, b marked
 * (AB16, as above) and h16 the marked output. The same functions per element as the forms
 * above, so the same bits. */
template <int AB16>
static __global__ void swiglu_forward8_kernel(uint16_t *h16, const void *a, const void *b,
                                              size_t n8)
{
    const int bf16 = AB16 == 2;
    MOE_CUDA_GRID_STRIDE(i, n8)
    {
        const moe_fvec<8> x = moe_ld_v<8, 1>(a, 8 * i, bf16), y = moe_ld_v<8, 1>(b, 8 * i, bf16);
        moe_fvec<8> v;
#pragma unroll
        for (int k = 0; k < 8; k++)
            v.v[k] = swiglu_h<float>(x.v[k], y.v[k]);
        moe_store16_v<8>(h16 + 8 * i, v, bf16);
    }
}

/* Whether SwiGLU on 16-bit inputs and outputs takes 8 elements a thread (16-byte
 * accesses): unless MOE_SWIGLU_VEC=4 (then the 4-element form; a benchmark knob, read
 * each call: the tests switch it). */
static bool swiglu_vec8(void) { return !moe_cuda_env_is("MOE_SWIGLU_VEC", "4"); }

static long n_vec8; /* launches of the 8-element kernels, forward and backward */

/* Launches of the 8-element SwiGLU kernels so far (for tests). */
extern "C" long moe_cuda_swiglu_vec8_launches(void) { return n_vec8; }

/* The 16-bit form of a marked output of n elements (NULL: write fp32). */
static uint16_t *in_place16(real *p, size_t n, int *bf16)
{
    return p && cuda_operand_in_place(p, n, bf16) ? (uint16_t *)p : NULL;
}

/* Whether a and b are marked (16-bit inputs); both or neither, else a failure. */
static int inputs16(const real *a, const real *b, size_t n, int *bf16)
{
    const int a16 = cuda_operand_in_place(a, n, bf16), b16 = b && cuda_operand_in_place(b, n, bf16);
    if (b && a16 != b16)
        MOE_CUDA_FAIL("swiglu: one of a, b is marked as 16-bit and the other is not");
    return a16;
}

/* Launches kernel K<F, AB16> (the fp32 mode: double; 16-bit modes: float, AB16 as marked:
 * 2 for bf16 inputs, 1 for fp16 ones, 0 for fp32 ones). */
#define SWIGLU_LAUNCH(K, fp32, ab16, bf16, blocks, ...)                                            \
    do {                                                                                           \
        if (fp32)                                                                                  \
            MOE_CUDA_LAUNCH((K<double, 0>), blocks, MOE_CUDA_THREADS, 0, __VA_ARGS__);             \
        else if (ab16 && bf16)                                                                     \
            MOE_CUDA_LAUNCH((K<float, 2>), blocks, MOE_CUDA_THREADS, 0, __VA_ARGS__);              \
        else if (ab16)                                                                             \
            MOE_CUDA_LAUNCH((K<float, 1>), blocks, MOE_CUDA_THREADS, 0, __VA_ARGS__);              \
        else                                                                                       \
            MOE_CUDA_LAUNCH((K<float, 0>), blocks, MOE_CUDA_THREADS, 0, __VA_ARGS__);              \
    } while (0)

extern "C" void cuda_swiglu_forward(real *h, const real *a, const real *b, size_t n)
{
    if (n == 0)
        return;
    const bool fp32 = cuda_gemm_precision() == MOE_PREC_FP32;
    int bf16 = 0;
    uint16_t *h16 = in_place16(h, n, &bf16);
    const int ab16 = inputs16(a, b, n, &bf16);
    const bool aligned = moe_aligned16(h) && moe_aligned16(a) && moe_aligned16(b);
    if (!fp32 && ab16 && h16 && n % 8 == 0 && aligned && swiglu_vec8()) {
        const unsigned blocks = moe_cuda_blocks(n / 8, MOE_CUDA_THREADS);
        n_vec8++;
        if (bf16)
            MOE_CUDA_LAUNCH(swiglu_forward8_kernel<2>, blocks, MOE_CUDA_THREADS, 0, h16,
                            (const void *)a, (const void *)b, n / 8);
        else
            MOE_CUDA_LAUNCH(swiglu_forward8_kernel<1>, blocks, MOE_CUDA_THREADS, 0, h16,
                            (const void *)a, (const void *)b, n / 8);
        return;
    }
    if (n % 4 == 0 && aligned) {
        const unsigned blocks = moe_cuda_blocks(n / 4, MOE_CUDA_THREADS);
        SWIGLU_LAUNCH(swiglu_forward4_kernel, fp32, ab16, bf16, blocks, (float4 *)h, (uint2 *)h16,
                      (const void *)a, (const void *)b, n / 4, bf16);
        return;
    }
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    SWIGLU_LAUNCH(swiglu_forward_kernel, fp32, ab16, bf16, blocks, h, h16, (const void *)a,
                  (const void *)b, n, bf16);
}

/* da or db may be NULL (that gradient is not wanted); b is read only for da. Both are
 * overwritten (ops.h); da16 / db16 as h16 above. AB16: a, b and dh are marked, 16-bit
 * (the experts' gate and up outputs and the gradient the down projection wrote). */
template <typename F, int AB16>
static __global__ void swiglu_backward_kernel(real *da, real *db, uint16_t *da16, uint16_t *db16,
                                              const void *dh, const void *a, const void *b,
                                              size_t n, int bf16_arg)
{
    const int bf16 = AB16_FORMAT(AB16, bf16_arg);
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        const F x = moe_ld<AB16>(a, i, bf16), s = sigmoid(x), g = moe_ld<AB16>(dh, i, bf16);
        if (da) {
            const real v = da_term<F>(g, x, s, moe_ld<AB16>(b, i, bf16));
            if (da16)
                da16[i] = moe_round16(v, bf16);
            else
                da[i] = v;
        }
        if (db) {
            const real v = db_term<F>(g, x, s);
            if (db16)
                db16[i] = moe_round16(v, bf16);
            else
                db[i] = v;
        }
    }
}

/* The same over n4 groups of 4 elements. */
template <typename F, int AB16>
static __global__ void swiglu_backward4_kernel(float4 *da, float4 *db, uint2 *da16, uint2 *db16,
                                               const void *dh, const void *a, const void *b,
                                               size_t n4, int bf16_arg)
{
    const int bf16 = AB16_FORMAT(AB16, bf16_arg);
    MOE_CUDA_GRID_STRIDE(i, n4)
    {
        const float4 a4 = moe_ld4<AB16>(a, 4 * i, bf16), g4 = moe_ld4<AB16>(dh, 4 * i, bf16);
        const F x[4] = {a4.x, a4.y, a4.z, a4.w}, g[4] = {g4.x, g4.y, g4.z, g4.w};
        const F s[4] = {sigmoid(x[0]), sigmoid(x[1]), sigmoid(x[2]), sigmoid(x[3])};
        if (da) {
            const float4 y = moe_ld4<AB16>(b, 4 * i, bf16);
            const float4 v =
                make_float4(da_term<F>(g[0], x[0], s[0], y.x), da_term<F>(g[1], x[1], s[1], y.y),
                            da_term<F>(g[2], x[2], s[2], y.z), da_term<F>(g[3], x[3], s[3], y.w));
            if (da16)
                da16[i] = moe_round16x4(v, bf16);
            else
                da[i] = v;
        }
        if (db) {
            const float4 v =
                make_float4(db_term<F>(g[0], x[0], s[0]), db_term<F>(g[1], x[1], s[1]),
                            db_term<F>(g[2], x[2], s[2]), db_term<F>(g[3], x[3], s[3]));
            if (db16)
                db16[i] = moe_round16x4(v, bf16);
            else
                db[i] = v;
        }
    }
}

/* The backward's 16-bit form over n8 groups of 8 elements: a, b, dh marked (AB16), da16
 * and db16 the marked outputs (both wanted). */
template <int AB16>
static __global__ void swiglu_backward8_kernel(uint16_t *da16, uint16_t *db16, const void *dh,
                                               const void *a, const void *b, size_t n8)
{
    const int bf16 = AB16 == 2;
    MOE_CUDA_GRID_STRIDE(i, n8)
    {
        const moe_fvec<8> x = moe_ld_v<8, 1>(a, 8 * i, bf16), g = moe_ld_v<8, 1>(dh, 8 * i, bf16),
                          y = moe_ld_v<8, 1>(b, 8 * i, bf16);
        moe_fvec<8> va, vb;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            const float s = sigmoid(x.v[k]);
            va.v[k] = da_term<float>(g.v[k], x.v[k], s, y.v[k]);
            vb.v[k] = db_term<float>(g.v[k], x.v[k], s);
        }
        moe_store16_v<8>(da16 + 8 * i, va, bf16);
        moe_store16_v<8>(db16 + 8 * i, vb, bf16);
    }
}

extern "C" void cuda_swiglu_backward(real *da, real *db, const real *dh, const real *a,
                                     const real *b, size_t n)
{
    if (n == 0 || (!da && !db))
        return;
    const bool fp32 = cuda_gemm_precision() == MOE_PREC_FP32;
    int bf16 = 0;
    uint16_t *da16 = in_place16(da, n, &bf16), *db16 = in_place16(db, n, &bf16);
    const int ab16 = inputs16(a, da ? b : NULL, n, &bf16);
    if (ab16 != cuda_operand_in_place(dh, n, &bf16))
        MOE_CUDA_FAIL("swiglu_backward: dh must be marked as 16-bit exactly when a and b are");
    const bool aligned = moe_aligned16(da) && moe_aligned16(db) && moe_aligned16(dh) &&
                         moe_aligned16(a) && moe_aligned16(b);
    if (!fp32 && ab16 && da16 && db16 && n % 8 == 0 && aligned && swiglu_vec8()) {
        const unsigned blocks = moe_cuda_blocks(n / 8, MOE_CUDA_THREADS);
        n_vec8++;
        if (bf16)
            MOE_CUDA_LAUNCH(swiglu_backward8_kernel<2>, blocks, MOE_CUDA_THREADS, 0, da16, db16,
                            (const void *)dh, (const void *)a, (const void *)b, n / 8);
        else
            MOE_CUDA_LAUNCH(swiglu_backward8_kernel<1>, blocks, MOE_CUDA_THREADS, 0, da16, db16,
                            (const void *)dh, (const void *)a, (const void *)b, n / 8);
        return;
    }
    if (n % 4 == 0 && aligned) {
        const unsigned blocks = moe_cuda_blocks(n / 4, MOE_CUDA_THREADS);
        SWIGLU_LAUNCH(swiglu_backward4_kernel, fp32, ab16, bf16, blocks, (float4 *)da, (float4 *)db,
                      (uint2 *)da16, (uint2 *)db16, (const void *)dh, (const void *)a,
                      (const void *)b, n / 4, bf16);
        return;
    }
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    SWIGLU_LAUNCH(swiglu_backward_kernel, fp32, ab16, bf16, blocks, da, db, da16, db16,
                  (const void *)dh, (const void *)a, (const void *)b, n, bf16);
}
