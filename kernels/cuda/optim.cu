/* kernels/cuda/optim.cu: the optimizer's pieces: sums and sums of squares in double (a
 * fixed grid and a fixed-order reduction, so the same input gives the same bits), added
 * into a double in device memory (sum_into: nothing waits) or copied back (sum_values,
 * sum_squares: waits for the stream), scaling, the finiteness check (also waits) and the
 * fused AdamW step (one pass, moe_adamw_elem per element: the CPU's float arithmetic; it
 * reads the sums of squares of the gradients on the device for its clipping factor or
 * skip; over the whole parameter
 * arena in a 16-bit precision it also writes the GEMMs' 16-bit shadow, so the refresh
 * that follows has nothing left to do; with bf16 master weights, master_in_shadow, the
 * elements from there on are read from the shadow and written back to it only, and with
 * bf16 gradients, grads_in_shadow, their gradients from the bf16 copy; the sums and the
 * finiteness check read a range inside that copy there). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/cuda_common.cuh"

#define SUM_MAX_BLOCKS 1024

/* The elements sum_partial reads: fp32 (real), or bf16 (uint16_t: gradients kept in
 * bf16, grads_in_shadow); W of them in 16 bytes. */
template <class T> struct sum_elem;
template <> struct sum_elem<real> {
    static constexpr int W = 4;
    static __device__ __forceinline__ double get(const real *x, size_t i) { return x[i]; }
    static __device__ __forceinline__ void group(double (&v)[W], const real *x, size_t c)
    {
        const float4 q = ((const float4 *)x)[c];
        v[0] = q.x;
        v[1] = q.y;
        v[2] = q.z;
        v[3] = q.w;
    }
};
template <> struct sum_elem<uint16_t> {
    static constexpr int W = 8;
    static __device__ __forceinline__ double get(const uint16_t *x, size_t i)
    {
        return moe_bf16_widen(x[i]);
    }
    static __device__ __forceinline__ void group(double (&v)[W], const uint16_t *x, size_t c)
    {
        const uint4 q = ((const uint4 *)x)[c];
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int e = 0; e < W; e++)
            v[e] = moe_bf16_widen((uint16_t)(w[e / 2] >> (16 * (e % 2))));
    }
};

/* part[block] = the block's sum (SQUARE: of squares) over x, in double. VEC: x is 16-byte
 * aligned; groups of W by one 16-byte load, each group summed first, the last n % W by
 * block 0. */
template <class T, int SQUARE, int VEC>
static __global__ void sum_partial(double *part, const T *x, size_t n)
{
    typedef sum_elem<T> E;
    double s = 0.0;
    if (VEC) {
        MOE_CUDA_GRID_STRIDE(c, n / E::W)
        {
            double v[E::W];
            E::group(v, x, c);
            double g = SQUARE ? v[0] * v[0] : v[0];
#pragma unroll
            for (int e = 1; e < E::W; e++)
                g += SQUARE ? v[e] * v[e] : v[e];
            s += g;
        }
        if (blockIdx.x == 0 && threadIdx.x < n % E::W) {
            const double v = E::get(x, n / E::W * E::W + threadIdx.x);
            s += SQUARE ? v * v : v;
        }
    } else {
        MOE_CUDA_GRID_STRIDE(i, n)
        {
            const double v = E::get(x, i);
            s += SQUARE ? v * v : v;
        }
    }
    s = moe_block_sum_d(s);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

extern "C" uint16_t *cuda_gemm_grad16_at(const void *x, size_t n);

/* *acc += the blocks' partial sums (added in a fixed order). */
static __global__ void sum_final(double *acc, const double *part, int blocks)
{
    double s = 0.0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x)
        s += part[b];
    s = moe_block_sum_d(s);
    if (threadIdx.x == 0)
        *acc = __dadd_rn(*acc, s);
}

/* The partials go to scratch, so acc must not lie in it. */
extern "C" void cuda_sum_into(double *acc, const real *x, size_t n, int square)
{
    if (n == 0)
        return;
    unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    if (blocks > SUM_MAX_BLOCKS)
        blocks = SUM_MAX_BLOCKS;
    double *part = (double *)moe_cuda_scratch(sizeof(double) * blocks);
    if (!part)
        return;
    const uint16_t *x16 = cuda_gemm_grad16_at(x, n); /* gradients kept in bf16 */
    const int vec = moe_aligned16(x16 ? (const void *)x16 : (const void *)x);
    moe_cuda_pick(
        [&](auto sq, auto vec_) {
            constexpr int SQ = decltype(sq)::value, VEC = decltype(vec_)::value;
            if (x16)
                MOE_CUDA_LAUNCH((sum_partial<uint16_t, SQ, VEC>), blocks, MOE_CUDA_THREADS, 0, part,
                                x16, n);
            else
                MOE_CUDA_LAUNCH((sum_partial<real, SQ, VEC>), blocks, MOE_CUDA_THREADS, 0, part, x,
                                n);
        },
        square != 0, vec != 0);
    MOE_CUDA_LAUNCH(sum_final, 1, MOE_CUDA_THREADS, 0, acc, part, (int)blocks);
}

/* A value on the host: summed into a zeroed double in the scratch after the partials
 * (the scratch grows here, so cuda_sum_into finds it as large), then copied back (waits). */
static double sum_of(const real *x, size_t n, int square)
{
    const unsigned blocks = moe_cuda_blocks(n, MOE_CUDA_THREADS);
    double *acc = (double *)moe_cuda_scratch(sizeof(double) * (SUM_MAX_BLOCKS + 1));
    if (!acc)
        return 0.0;
    acc += blocks < SUM_MAX_BLOCKS ? blocks : SUM_MAX_BLOCKS;
    if (!MOE_CUDA_OK(cudaMemsetAsync(acc, 0, sizeof(double), moe_cuda_stream())))
        return 0.0;
    cuda_sum_into(acc, x, n, square);
    const double *host = (const double *)moe_cuda_fetch(acc, sizeof(double));
    return host ? *host : 0.0;
}

extern "C" double cuda_sum_values(const real *x, size_t n) { return sum_of(x, n, 0); }
extern "C" double cuda_sum_squares(const real *x, size_t n) { return sum_of(x, n, 1); }

static __global__ void scale_kernel(real *x, real s, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n) { x[i] = __fmul_rn(x[i], s); }
}

extern "C" void cuda_scale_inplace(real *x, real s, size_t n)
{
    if (n == 0)
        return;
    MOE_CUDA_LAUNCH(scale_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0, x, s,
                    n);
}

/* *bad = 1 if some element is not finite (every writer writes the same value). */
static __global__ void finite_kernel(int *bad, const real *x, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        if (!isfinite(x[i]))
            *bad = 1;
    }
}

/* The same over bf16 values: all exponent bits set is an infinity or a NaN. */
static __global__ void finite16_kernel(int *bad, const uint16_t *x, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n)
    {
        if ((x[i] & 0x7f80u) == 0x7f80u)
            *bad = 1;
    }
}

extern "C" int cuda_all_finite(const real *x, size_t n)
{
    if (n == 0)
        return 1;
    int *bad = (int *)moe_cuda_scratch(sizeof(int));
    if (!bad || !MOE_CUDA_OK(cudaMemsetAsync(bad, 0, sizeof(int), moe_cuda_stream())))
        return 0;
    const uint16_t *x16 = cuda_gemm_grad16_at(x, n); /* gradients kept in bf16 */
    if (x16)
        MOE_CUDA_LAUNCH(finite16_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                        bad, x16, n);
    else
        MOE_CUDA_LAUNCH(finite_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                        bad, x, n);
    const int *host = (const int *)moe_cuda_fetch(bad, sizeof(int));
    return host ? !*host : 0;
}

static __global__ void adamw_kernel(real *p, const real *g, real *m, real *v, size_t n, real wd,
                                    moe_adamw_consts c)
{
    const real decay = moe_adamw_decay(&c, wd);
    MOE_CUDA_GRID_STRIDE(i, n) { p[i] = moe_adamw_elem(p[i], g[i], &m[i], &v[i], decay, 1, &c); }
}

extern "C" void cuda_adamw_update(real *p, const real *g, real *m, real *v, size_t n, real lr,
                                  real beta1, real beta2, real eps, real wd, int t)
{
    if (n == 0)
        return;
    MOE_CUDA_LAUNCH(adamw_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0, p, g,
                    m, v, n, wd, moe_adamw_setup(lr, beta1, beta2, eps, t));
}

/* Multi-tensor AdamW: one pass over the arena. The segment offsets and weight decays are
 * staged in shared memory; a thread's elements only grow (grid stride), so its segment
 * is found once by binary search and then only walks forward. The gradients' factor
 * (clipping and loss scale, or skip) is computed by every thread from the two sums of
 * squares in device memory. W = 8 or 4: each thread step takes W consecutive elements
 * (16-byte loads and stores where 16-bit values fill them: 8 bf16 moments or shadow
 * values in one; the caller picks the widest the alignments allow), the last n % W one
 * by one; W = 1: one by one throughout. The arithmetic per element is the same in every
 * form. A step of W finds its segment and its side of the squares' split once where it
 * lies in one (as good as always): with bf16 master weights the pass was bound by its
 * instruction issue, not memory (an H200 at the bench shape: 5.93 ms, 75% of copy
 * bandwidth, with a segment search and a split test per element, 4 elements a step and
 * the moments rounded by integer arithmetic; 4.65 ms, 96%, now). */

/* The segment of element i, walking forward from seg (-1: not found yet). */
static __device__ __forceinline__ int adamw_seg(int seg, size_t i, const int64_t *seg_lo,
                                                int n_segs)
{
    if (seg < 0) {
        int lo = 0, hi = n_segs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) / 2;
            if ((int64_t)i >= seg_lo[mid])
                lo = mid;
            else
                hi = mid - 1;
        }
        return lo;
    }
    while (seg + 1 < n_segs && (int64_t)i >= seg_lo[seg + 1])
        seg++;
    return seg;
}

/* W (4 or 8) consecutive values of group c: fp32 ones (16-byte loads and stores), or
 * 16-bit ones widened from bf16 (8 or 16 bytes) and rounded back. */
template <int W>
static __device__ __forceinline__ void load_f32(float *dst, const real *src, size_t c)
{
#pragma unroll
    for (int h = 0; h < W / 4; h++) {
        const float4 q = ((const float4 *)src)[(size_t)W / 4 * c + h];
        dst[4 * h] = q.x;
        dst[4 * h + 1] = q.y;
        dst[4 * h + 2] = q.z;
        dst[4 * h + 3] = q.w;
    }
}

template <int W>
static __device__ __forceinline__ void store_f32(real *dst, const float *src, size_t c)
{
#pragma unroll
    for (int h = 0; h < W / 4; h++)
        ((float4 *)dst)[(size_t)W / 4 * c + h] =
            make_float4(src[4 * h], src[4 * h + 1], src[4 * h + 2], src[4 * h + 3]);
}

/* 16-bit words packed two to a 32-bit lane: W / 2 lanes (uint2 or uint4). */
template <int W> struct bits16 {
    uint32_t w[W >= 2 ? W / 2 : 1];
};

template <int W> static __device__ __forceinline__ bits16<W> load_16(const void *src, size_t c)
{
    bits16<W> b;
    if (W == 8) {
        const uint4 q = ((const uint4 *)src)[c];
        b.w[0] = q.x, b.w[1] = q.y, b.w[W / 2 - 2] = q.z, b.w[W / 2 - 1] = q.w;
    } else {
        const uint2 q = ((const uint2 *)src)[c];
        b.w[0] = q.x, b.w[1] = q.y;
    }
    return b;
}

template <int W>
static __device__ __forceinline__ void store_16(void *dst, size_t c, const bits16<W> &b)
{
    if (W == 8)
        ((uint4 *)dst)[c] = make_uint4(b.w[0], b.w[1], b.w[W / 2 - 2], b.w[W / 2 - 1]);
    else
        ((uint2 *)dst)[c] = make_uint2(b.w[0], b.w[1]);
}

template <int W> static __device__ __forceinline__ void widen_bf16(float *dst, const bits16<W> &b)
{
#pragma unroll
    for (int e = 0; e < W; e++)
        dst[e] = moe_bf16_widen((uint16_t)(b.w[e / 2] >> (16 * (e % 2))));
}

/* Two moments rounded to bf16 (to nearest even), a low, b high: on sm_80 and later one
 * conversion instruction (the pass is bound by its instruction issue with bf16 master
 * weights); the same bits as moe_bf16_round for every value but a NaN, which stays a
 * NaN of another payload. */
static __device__ __forceinline__ uint32_t bf16x2_round(float a, float b)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return (uint32_t)__bfloat16_as_ushort(h.x) | (uint32_t)__bfloat16_as_ushort(h.y) << 16;
#else
    return moe_bf16_round(a) | (uint32_t)moe_bf16_round(b) << 16;
#endif
}

/* A bf16 master weight's new value, x rounded stochastically: up (in magnitude) with
 * probability (|x| - |down|) / ulp, so that an update smaller than half an ulp still
 * moves the weight on average (rounding to nearest would drop it every time). r: 16
 * random bits; adding them below the kept bits and truncating does it (a carry into the
 * exponent is the next binade's first value, as it should be). */
static __device__ __forceinline__ uint16_t bf16_round_stochastic(float x, uint32_t r)
{
    const uint32_t b = __float_as_uint(x);
    if ((b & 0x7f800000u) == 0x7f800000u)
        return moe_bf16_round(x); /* inf, nan */
    return (uint16_t)((b + (r & 0xffffu)) >> 16);
}

/* 64 random bits for the group of 4 elements 4c .. 4c + 3 at the step's seed (16 each,
 * element 4c + e taking bits 16e ..): one hash of (c, seed) spread by a 64-bit product,
 * so the same (element, step) gives the same bits in either form of the kernel, and a
 * resumed run repeats them; a few integer operations per element, since the pass is
 * bound by memory only while its arithmetic stays small. */
static __device__ __forceinline__ uint64_t sr_bits(size_t c, uint32_t seed)
{
    uint32_t h = (uint32_t)c * 0x9e3779b1u ^ (uint32_t)(c >> 32) * 0x85ebca77u ^ seed * 0xc2b2ae3du;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    return (uint64_t)h * 0x9e3779b97f4a7c15ull;
}

/* Element i's step (the tail and the unaligned form), gi its gradient. p16: its master
 * weight is the bf16 shadow's (read there, written back rounded stochastically with
 * seed, the arena's copy left as it is). */
template <int M16>
static __device__ __forceinline__ void
adamw_one(real *p, real gi, void *m, void *v, size_t i, real decay, real scale,
          const moe_adamw_consts &ac, uint16_t *shadow, int bf16, bool p16, uint32_t seed)
{
    uint16_t *m16 = (uint16_t *)m, *v16 = (uint16_t *)v;
    real *mr = (real *)m, *vr = (real *)v;
    real mi = M16 ? moe_bf16_widen(m16[i]) : mr[i], vi = M16 ? moe_bf16_widen(v16[i]) : vr[i];
    const real pin = p16 ? moe_bf16_widen(shadow[i]) : p[i];
    const real pi = moe_adamw_elem(pin, gi, &mi, &vi, decay, scale, &ac);
    if (!p16)
        p[i] = pi;
    if (M16) {
        m16[i] = moe_bf16_round(mi);
        v16[i] = moe_bf16_round(vi);
    } else {
        mr[i] = mi;
        vr[i] = vi;
    }
    if (shadow)
        shadow[i] =
            p16 ? bf16_round_stochastic(pi, (uint32_t)(sr_bits(i / 4, seed) >> (16 * (i % 4))))
                : moe_round16(pi, bf16);
}

/* Adds the square of gradient element i (as a double) to below or from the split (two
 * scalars: an array indexed by the comparison went to local memory, 12% slower). */
static __device__ __forceinline__ void adamw_square(double &below, double &from, real gi, size_t i,
                                                    size_t split)
{
    const double a = gi;
    if (i < split)
        below += a * a;
    else
        from += a * a;
}

/* Blocks an SM the registers must allow: 6 with bf16 moments (40 registers, the figure
 * without the sums of squares), 5 with fp32 ones (that form spills at 6); 4 for steps of
 * 8 elements (up to 60 registers; they spill at 6). sm_75 has room
 * for 1024 threads an SM, 4 blocks (the bound would be ignored, with a warning). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define ADAMW_MIN_BLOCKS(W, M16) 4
#else
#define ADAMW_MIN_BLOCKS(W, M16) ((W) == 8 ? 4 : (M16) ? 6 : 5)
#endif

/* Steps the elements [lo, hi) of the arena of n (ops.h): the groups of W that lie in it
 * in the vector form, the elements of its unaligned ends (fewer than W each) one a
 * thread in block 0.
 * M16: the moments are bf16 (ops.h): widened before the element's step, rounded after.
 * SQ: the block's sums of squares of the gradients, below n_split and from it, go to
 * part[2 block], part[2 block + 1] (adamw_square_final adds them up in block order).
 * Elements from from16 on (n: none; a multiple of W in the vector forms) have bf16 master
 * weights: the shadow's (bf16), read and written there only, rounded stochastically
 * with the step's seed; their gradients are g16's (bf16, element i at g16[i - from16])
 * where g16 is not NULL, else g's. */
template <int W, int M16, int SQ>
static __global__ void __launch_bounds__(MOE_CUDA_THREADS, ADAMW_MIN_BLOCKS(W, M16))
    adamw_multi_kernel(real *p, const real *g, void *m, void *v, const int64_t *offsets,
                       const real *wd, int n_segs, size_t lo, size_t hi, moe_adamw_consts ac,
                       const double *norm_sq, double clip, double loss_scale, uint16_t *shadow,
                       int bf16, double *part, size_t n_split, size_t from16, uint32_t seed,
                       const uint16_t *g16)
{
    const double factor =
        norm_sq ? moe_adamw_factor(norm_sq, clip, loss_scale) : (double)(float)(1.0 / loss_scale);
    if (!SQ && factor < 0) /* a gradient is not finite: the step is skipped */
        return;
    const real scale = (real)factor;
    extern __shared__ int64_t seg_lo[]; /* n_segs offsets, then n_segs decay factors */
    real *seg_decay = (real *)(seg_lo + n_segs);
    for (int s = threadIdx.x; s < n_segs; s += blockDim.x) {
        seg_lo[s] = offsets[s];
        seg_decay[s] = moe_adamw_decay(&ac, wd[s]);
    }
    __syncthreads();
    double below = 0.0, from = 0.0; /* squares of the gradients below n_split, from it */
    int seg = -1;
    if (factor >= 0 && W > 1) {
        const size_t c_lo = (lo + W - 1) / W, c_hi = hi / W;
        for (size_t c = c_lo + (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < c_hi;
             c += (size_t)blockDim.x * gridDim.x) {
            const size_t i0 = (size_t)W * c;
            const bool p16 = i0 >= from16;
            float pe[W], ge[W], me[W], ve[W];
            if (p16)
                widen_bf16<W>(pe, load_16<W>(shadow, c));
            else
                load_f32<W>(pe, p, c);
            if (p16 && g16)
                widen_bf16<W>(ge, load_16<W>(g16, c - from16 / W));
            else
                load_f32<W>(ge, g, c);
            if (M16) {
                widen_bf16<W>(me, load_16<W>(m, c));
                widen_bf16<W>(ve, load_16<W>(v, c));
            } else {
                load_f32<W>(me, (const real *)m, c);
                load_f32<W>(ve, (const real *)v, c);
            }
            /* the group's segment and side of the split, found once where the group lies
             * in one (nearly always); the squares in the same order either way */
            seg = adamw_seg(seg, i0, seg_lo, n_segs);
            const bool one_seg = seg + 1 >= n_segs || (int64_t)(i0 + W) <= seg_lo[seg + 1];
            real decay = seg_decay[seg];
            if (SQ && i0 >= n_split) {
#pragma unroll
                for (int e = 0; e < W; e++)
                    from += (double)ge[e] * (double)ge[e];
            } else if (SQ && i0 + W <= n_split) {
#pragma unroll
                for (int e = 0; e < W; e++)
                    below += (double)ge[e] * (double)ge[e];
            } else if (SQ) {
#pragma unroll
                for (int e = 0; e < W; e++)
                    adamw_square(below, from, ge[e], i0 + e, n_split);
            }
#pragma unroll
            for (int e = 0; e < W; e++) {
                if (!one_seg) {
                    seg = adamw_seg(seg, i0 + e, seg_lo, n_segs);
                    decay = seg_decay[seg];
                }
                pe[e] = moe_adamw_elem(pe[e], ge[e], &me[e], &ve[e], decay, scale, &ac);
            }
            if (!p16)
                store_f32<W>(p, pe, c);
            bits16<W> out;
            if (M16) {
#pragma unroll
                for (int e = 0; e < W; e += 2)
                    out.w[e / 2] = bf16x2_round(me[e], me[e + 1]);
                store_16<W>(m, c, out);
#pragma unroll
                for (int e = 0; e < W; e += 2)
                    out.w[e / 2] = bf16x2_round(ve[e], ve[e + 1]);
                store_16<W>(v, c, out);
            } else {
                store_f32<W>((real *)m, me, c);
                store_f32<W>((real *)v, ve, c);
            }
            if (p16) {
#pragma unroll
                for (int q = 0; q < W / 4; q++) { /* the bits of group (of 4) i0 / 4 + q */
                    const uint64_t r = sr_bits(i0 / 4 + q, seed);
                    out.w[2 * q] =
                        bf16_round_stochastic(pe[4 * q], (uint32_t)r) |
                        (uint32_t)bf16_round_stochastic(pe[4 * q + 1], (uint32_t)(r >> 16)) << 16;
                    out.w[2 * q + 1] =
                        bf16_round_stochastic(pe[4 * q + 2], (uint32_t)(r >> 32)) |
                        (uint32_t)bf16_round_stochastic(pe[4 * q + 3], (uint32_t)(r >> 48)) << 16;
                }
                store_16<W>(shadow, c, out);
            } else if (shadow) {
#pragma unroll
                for (int e = 0; e < W; e += 2)
                    out.w[e / 2] = moe_round16(pe[e], bf16) | (uint32_t)moe_round16(pe[e + 1], bf16)
                                                                  << 16;
                store_16<W>(shadow, c, out);
            }
        }
        /* the ends: [lo, W c_lo) and [W c_hi, hi), or [lo, hi) when no group lies inside */
        const size_t head = c_lo < c_hi ? W * c_lo - lo : hi - lo;
        const size_t tail = c_lo < c_hi ? hi - W * c_hi : 0;
        if (blockIdx.x == 0 && threadIdx.x < head + tail) { /* one element per thread */
            const size_t i = threadIdx.x < head ? lo + threadIdx.x : W * c_hi + threadIdx.x - head;
            const real gi = i >= from16 && g16 ? moe_bf16_widen(g16[i - from16]) : g[i];
            if (SQ)
                adamw_square(below, from, gi, i, n_split);
            seg = adamw_seg(-1, i, seg_lo, n_segs);
            adamw_one<M16>(p, gi, m, v, i, seg_decay[seg], scale, ac, shadow, bf16, i >= from16,
                           (uint32_t)seed);
        }
    } else if (factor >= 0) {
        for (size_t i = lo + (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < hi;
             i += (size_t)blockDim.x * gridDim.x) {
            const real gi = i >= from16 && g16 ? moe_bf16_widen(g16[i - from16]) : g[i];
            if (SQ)
                adamw_square(below, from, gi, i, n_split);
            seg = adamw_seg(seg, i, seg_lo, n_segs);
            adamw_one<M16>(p, gi, m, v, i, seg_decay[seg], scale, ac, shadow, bf16, i >= from16,
                           (uint32_t)seed);
        }
    }
    if (SQ) {
        below = moe_block_sum_d(below);
        from = moe_block_sum_d(from);
        if (threadIdx.x == 0) {
            part[2 * blockIdx.x] = below;
            part[2 * blockIdx.x + 1] = from;
        }
    }
}

#define ADAMW_MAX_BLOCKS 32768

/* out[0], out[1] = the blocks' partial sums of squares below and from the split. Thread
 * t adds the partials of blocks t, t + T, t + 2T, ... (T threads) into ADAMW_SQ_LANES
 * running sums in turn, so that that many 16-byte loads are in flight (one sum a thread
 * waited on each load: 34 us for 32768 partials, once a piece of the update), then the
 * lanes and the block in a fixed order. */
#define ADAMW_SQ_LANES 8
static __global__ void adamw_square_final(double *out, const double *part, int blocks)
{
    double2 s[ADAMW_SQ_LANES];
#pragma unroll
    for (int u = 0; u < ADAMW_SQ_LANES; u++)
        s[u] = make_double2(0.0, 0.0);
    const double2 *p2 = (const double2 *)part;
    int b = threadIdx.x;
    for (; b + (ADAMW_SQ_LANES - 1) * (int)blockDim.x < blocks; b += ADAMW_SQ_LANES * blockDim.x) {
        double2 v[ADAMW_SQ_LANES];
#pragma unroll
        for (int u = 0; u < ADAMW_SQ_LANES; u++)
            v[u] = p2[b + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < ADAMW_SQ_LANES; u++) {
            s[u].x += v[u].x;
            s[u].y += v[u].y;
        }
    }
    for (; b < blocks; b += blockDim.x) { /* fewer than ADAMW_SQ_LANES left */
        s[0].x += p2[b].x;
        s[0].y += p2[b].y;
    }
    double below = 0.0, from = 0.0;
#pragma unroll
    for (int u = 0; u < ADAMW_SQ_LANES; u++) {
        below += s[u].x;
        from += s[u].y;
    }
    below = moe_block_sum_d(below);
    from = moe_block_sum_d(from);
    if (threadIdx.x == 0) {
        out[0] = below;
        out[1] = from;
    }
}

extern "C" uint16_t *cuda_gemm_shadow_for_update(const real *p, const real *g, size_t n, int *bf16,
                                                 size_t *from16, const uint16_t **g16);

/* The blocks' partial sums of squares: buffers of the update's own, not the backend's
 * scratch, since the update may run on the background queue beside other ops
 * (backend.h background). On the background, adamw_square_final runs on the stream beside
 * it (moe_cuda_aside_begin), so that the next piece of the update does not wait for one
 * block adding 32768 partials (138 us a piece beside the backward's kernels at the bench
 * shape on an H200, 10 pieces a step); so the pieces take the buffers in turn, and a
 * piece waits for the sum that last read its buffer (done long before). */
#define ADAMW_PART_RING 4
static double *adamw_part[ADAMW_PART_RING];
static cudaEvent_t adamw_part_read[ADAMW_PART_RING]; /* recorded after each buffer's sum */
static int adamw_part_next;

extern "C" void cuda_adamw_update_multi(real *p, const real *g, void *m, void *v, int moments16,
                                        size_t n, size_t lo, size_t hi, const int64_t *offsets,
                                        const real *wd, int n_segs, real lr, real beta1, real beta2,
                                        real eps, const double *norm_sq, double clip,
                                        double loss_scale, int t, double *sq_out, size_t n_split)
{
    hi = hi < n ? hi : n;
    lo = lo < hi ? lo : hi;
    if (n_segs <= 0 || lo == hi) {
        if (sq_out)
            MOE_CUDA_OK(cudaMemsetAsync(sq_out, 0, 2 * sizeof(double), moe_cuda_stream()));
        return;
    }
    int bf16 = 0;               /* the 16-bit shadow of the parameters, written in the same pass */
    size_t from16 = n;          /* bf16 master weights from there on (master_in_shadow) */
    const uint16_t *g16 = NULL; /* and their bf16 gradients (grads_in_shadow) */
    uint16_t *shadow = cuda_gemm_shadow_for_update(p, g, n, &bf16, &from16, &g16);
    const size_t smem = (sizeof(int64_t) + sizeof(real)) * (size_t)n_segs;
    if (smem > 48 * 1024) {
        MOE_CUDA_FAIL("adamw: %d segments are more than the kernel stages (%zu bytes)", n_segs,
                      smem);
        return;
    }
    const moe_adamw_consts c = moe_adamw_setup(lr, beta1, beta2, eps, t);
    const uintptr_t moments = (uintptr_t)m | (uintptr_t)v;
    /* W consecutive elements a thread step: the largest of 8, 4 the alignments allow */
    int width = 1;
    for (int w = 8; w >= 4 && width == 1; w /= 2)
        if (((uintptr_t)p | (uintptr_t)g) % 16 == 0 && moments % (moments16 ? 2 * w : 16) == 0 &&
            (uintptr_t)shadow % (2 * w) == 0 && (from16 == n || from16 % w == 0))
            width = w;
    static int want = -1; /* MOE_ADAMW_WIDTH=4: steps of 4 at most (a knob for tests) */
    if (want < 0) {
        const char *e = getenv("MOE_ADAMW_WIDTH");
        want = e ? atoi(e) : 8;
    }
    if (width > want && want >= 4)
        width = want;
    unsigned blocks = moe_cuda_blocks((hi - lo) / width + 1, MOE_CUDA_THREADS);
    /* Many waves of blocks, but not one block per 1024 elements: each block stages the
     * segments and searches its first one (on an H200, 1.2 M blocks took 6.38 ms at the
     * bench shape, 32768 blocks 5.88 ms with the sums of squares added; 1024 blocks made
     * 1.3 waves, 29% slower) */
    if (blocks > ADAMW_MAX_BLOCKS)
        blocks = ADAMW_MAX_BLOCKS;
    double *part = NULL;
    const int slot = adamw_part_next;
    if (sq_out) { /* a fixed grid, so the partials have a fixed count and order */
        if (!adamw_part[slot] &&
            (!MOE_CUDA_OK(
                 cudaMalloc((void **)&adamw_part[slot], sizeof(double) * 2 * ADAMW_MAX_BLOCKS)) ||
             !MOE_CUDA_OK(
                 cudaEventCreateWithFlags(&adamw_part_read[slot], cudaEventDisableTiming)) ||
             !MOE_CUDA_OK(cudaEventRecord(adamw_part_read[slot], moe_cuda_stream()))))
            return;
        if (!MOE_CUDA_OK(cudaStreamWaitEvent(moe_cuda_stream(), adamw_part_read[slot], 0)))
            return;
        part = adamw_part[slot];
        adamw_part_next = (slot + 1) % ADAMW_PART_RING;
    }
#define ADAMW_LAUNCH(W, M16)                                                                       \
    do {                                                                                           \
        if (part)                                                                                  \
            MOE_CUDA_LAUNCH((adamw_multi_kernel<W, M16, 1>), blocks, MOE_CUDA_THREADS, smem, p, g, \
                            m, v, offsets, wd, n_segs, lo, hi, c, norm_sq, clip, loss_scale,       \
                            shadow, bf16, part, n_split, from16, (uint32_t)t, g16);                \
        else                                                                                       \
            MOE_CUDA_LAUNCH((adamw_multi_kernel<W, M16, 0>), blocks, MOE_CUDA_THREADS, smem, p, g, \
                            m, v, offsets, wd, n_segs, lo, hi, c, norm_sq, clip, loss_scale,       \
                            shadow, bf16, part, n_split, from16, (uint32_t)t, g16);                \
    } while (0)
    if (width == 8)
        MOE_CUDA_PICK2(1, moments16, ADAMW_LAUNCH, 8, 8, 1, 0);
    else
        MOE_CUDA_PICK2(width == 4, moments16, ADAMW_LAUNCH, 4, 1, 1, 0);
#undef ADAMW_LAUNCH
    if (part) {
        static int use_aside = -1; /* MOE_ADAMW_ASIDE=0: on the update's own stream (a knob) */
        if (use_aside < 0)
            use_aside = !moe_cuda_env_is("MOE_ADAMW_ASIDE", "0");
        const int aside = use_aside && moe_cuda_aside_begin();
        MOE_CUDA_LAUNCH(adamw_square_final, 1, MOE_CUDA_THREADS, 0, sq_out, part, (int)blocks);
        MOE_CUDA_OK(cudaEventRecord(adamw_part_read[slot], moe_cuda_stream()));
        if (aside)
            moe_cuda_aside_end();
    }
}
