/* kernels/cuda/attention_mma.cuh: device helpers shared by the tensor-core attention
 * kernels of attention.cu (wmma, mma.sync) and of sm90/attention_wgmma.cu (wgmma): the
 * 16-bit pair type, ldmatrix, ex2, the causal-mask walk over a 16 x 64 fragment, cp.async
 * groups, the store of a warp's gradient rows. After cuda_common.cuh (real). */
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

/* The 16-bit type: rounding of two floats into a pair. */
template <class T16> struct fa_type;
template <> struct fa_type<__half> {
    typedef __half2 pair;
    static __device__ __forceinline__ pair pack(float a, float b)
    {
        return __floats2half2_rn(a, b);
    }
};
template <> struct fa_type<__nv_bfloat16> {
    typedef __nv_bfloat162 pair;
    static __device__ __forceinline__ pair pack(float a, float b)
    {
        return __floats2bfloat162_rn(a, b);
    }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FM_SKIP 1
#else
#define FM_SKIP 0
#endif

/* Four 8x8 16-bit matrices from shared memory; lanes 8i..8i+7 give the rows of matrix i.
 * trans: each lane receives a column pair instead of a row pair. */
static __device__ __forceinline__ void fm_ldsm(unsigned (&r)[4], const void *p)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}
static __device__ __forceinline__ void fm_ldsm_t(unsigned (&r)[4], const void *p)
{
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

/* 2^x by the special-function unit, denormal results flushed to 0 (a probability below
 * 2^-126 adds nothing an fp32 sum keeps); 2^-inf = 0. exp2f adds the denormal range's
 * scaling around the same instruction. */
static __device__ __forceinline__ float fm_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* f(n, e, keep) over a warp's 16 x 64 fragment (column tile n, element e), keep being
 * in(n, e): whether the causal mask keeps that score. full: the tile lies wholly on the
 * kept side of the diagonal, and f runs with keep = true, a constant (no test). */
template <class In, class F> static __device__ __forceinline__ void fm_each(bool full, In in, F f)
{
    if (full) {
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                f(n, e, true);
    } else {
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                f(n, e, in(n, e));
    }
}

template <class T16> static __device__ __forceinline__ unsigned fm_pack(float a, float b)
{
    typename fa_type<T16>::pair p = fa_type<T16>::pack(a, b); /* a in the low half */
    return *(unsigned *)&p;
}

static __device__ __forceinline__ void fm_commit(void)
{
#if !FM_SKIP
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/* Waits for every committed cp.async of this thread (the caller then synchronises). */
static __device__ __forceinline__ void fm_wait_all(void)
{
#if !FM_SKIP
    asm volatile("cp.async.wait_group 0;\n" ::);
#endif
}

/* Waits until at most N of this thread's committed cp.async groups are pending. */
template <int N> static __device__ __forceinline__ void fm_wait_group(void)
{
#if !FM_SKIP
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

/* g[base + row] = mul * acc for the lane's 2 rows (row0 + lane / 4, + 8) below T, columns
 * < Hd; o16: g holds T16 values (a marked buffer), else fp32. */
template <class T16, int HD>
static __device__ __forceinline__ void
fm_store_rows(real *g, size_t base, size_t ld, int row0, int T, int Hd, float mul,
              const float (&acc)[HD / 8][4], int lane, int o16)
{
    if (!g)
        return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + (lane >> 2) + 8 * r;
        if (row >= T)
            continue;
        const size_t at = base + (size_t)row * ld + 2 * (lane & 3);
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            if (8 * n + 2 * (lane & 3) >= Hd)
                continue;
            const float a = mul * acc[n][2 * r], b = mul * acc[n][2 * r + 1];
            if (o16)
                *(unsigned *)((T16 *)g + at + 8 * n) = fm_pack<T16>(a, b);
            else
                *(float2 *)(g + at + 8 * n) = make_float2(a, b);
        }
    }
}

/* lse * log2(e) and Di (dsum) of a lane's 2 rows of (sequence, head) bh; 0 past T. */
static __device__ __forceinline__ void fm_row_stats(float (&lse2)[2], float (&Di)[2],
                                                    const real *lse, const float *dsum, int bh,
                                                    int T, const int (&row)[2])
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        lse2[r] = row[r] < T ? lse[(size_t)bh * T + row[r]] * FA_LOG2E : 0.f;
        Di[r] = row[r] < T ? dsum[(size_t)bh * T + row[r]] : 0.f;
    }
}

/* The statistics of query rows [i0, i0 + 64) of (sequence, head) bh into st (lse * log2(e))
 * and st + 64 (Di), by threads 0..63; 0 past T. */
static __device__ __forceinline__ void fm_stage_stats(float *st, const real *lse, const float *dsum,
                                                      int bh, int T, int i0)
{
    if (threadIdx.x < 64) {
        const int i = i0 + threadIdx.x;
        st[threadIdx.x] = i < T ? lse[(size_t)bh * T + i] * FA_LOG2E : 0.f;
        st[64 + threadIdx.x] = i < T ? dsum[(size_t)bh * T + i] : 0.f;
    }
}
