/* kernels/cuda/sm90/attention_wgmma.cu: the causal attention, forward and backward, on
 * Hopper's warpgroup MMA (wgmma, sm_90a), for head dim 64 in bf16 / fp16 precision;
 * attention.cu takes it on compute capability 9.0 (its mma.sync kernels elsewhere, or with
 * MOE_ATTENTION=mma).
 *
 * The same walks, online softmax, outputs and lse as attention.cu's fm_* kernels, but a
 * warpgroup owns 64 rows: per 64-key tile the forward forms S = Q K^T (64 x 64) with 4
 * wgmma of k = 16 (A: the warpgroup's Q tile, B: the K tile, both in shared memory,
 * K-major) and O += P V with 4 more (A: the probabilities, rounded in pairs from S's
 * accumulators, whose layout is wgmma's register A; B: the V tile, MN-major). A warpgroup
 * reads each B tile once, where mma.sync's warps each load it through ldmatrix (four times
 * the shared-memory traffic). Tiles arrive by cp.async; sm90/wgmma.cuh has the layouts.
 * Sums are in a fixed order: deterministic. (Q's A operand taken into registers by
 * ldmatrix, as mma.sync's kernels do, gave wrong outputs past one key tile on the H200,
 * although a one-tile probe of the same helpers was exact; from shared memory, as the
 * backward's kernels take theirs, it is right.) */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/sm90/attention_wgmma.h"
#include "kernels/cuda/sm90/wgmma.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FW_SKIP 1 /* never: CMakeLists.txt builds this file for sm_90a alone */
#else
#define FW_SKIP 0
#endif

/* Q (a tile a warpgroup), K0, V0, K1, V1, and room to align the start to 1024 bytes */
/* The forward's end: the lane's 2 rows of out = O / l (o16: T16 values) and their lse,
 * from its share of the row sums l (added over the quad here) and the maxima m. */
template <class T16>
static __device__ __forceinline__ void
fw_forward_finish(real *out, real *lse, const float (&o)[32], const float (&m)[2], float (&l)[2],
                  const int (&row)[2], size_t base, size_t ld, int bh, int T, int quad, int o16)
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[r], 2);
        if (row[r] >= T)
            continue;
        const float inv = 1.f / l[r];
        const size_t orow = base + (size_t)row[r] * ld + 2 * quad;
#pragma unroll
        for (int n = 0; n < 8; n++) {
            const float a = o[4 * n + 2 * r] * inv, c = o[4 * n + 2 * r + 1] * inv;
            if (o16)
                *(unsigned *)((T16 *)out + orow + 8 * n) = fm_pack<T16>(a, c);
            else
                *(float2 *)(out + orow + 8 * n) = make_float2(a, c);
        }
        if (quad == 0)
            lse[(size_t)bh * T + row[r]] = (m[r] + log2f(l[r])) * FA_LN2;
    }
}

/* The forward and dq kernels are pipelined: a warpgroup does not wait for each product
 * before its elementwise work. At step u it issues the first products of tile u (S, or S
 * and dP) and the second ones of tile u - 1 (P V, or dS K) as two groups, waits for the
 * first only, does tile u's elementwise work while the tensor cores run tile u - 1's
 * products, then waits for those and rounds tile u's P (dS) into the registers its
 * products read at step u + 1: the same products and sums in the same order as waiting
 * for each (the sixteenth session's kernels gave the same bits both ways), 4-10% faster.
 * The walked tiles sit in S buffers (FW_STAGES); tile u + S - 2 is copied from step u on,
 * tiles u - 1 and u are read (dq: K in S buffers, V, read at step u only, in S - 1). Every
 * warpgroup of a block walks all the block's tiles: one wholly past a warpgroup's rows
 * adds exact zeros (exp2(-inf) = 0, its correction exp2(0) = 1), and no product is then
 * issued under a condition, which ptxas would serialize (as it does where registers run
 * short: dq's blocks of 2 warpgroups take 1 an SM, for 255 registers). The dk/dv kernel
 * is not pipelined: so it measured 519 against 451 us a call at the bench shape (202
 * registers, 1 block of 2 warpgroups an SM; serialized at 168, 3 blocks of 1). */
#define FW_STAGES 4
#define FW_SMEM(NWG) (((NWG) + 2 * FW_STAGES) * FW_TILE + 1024)

using fw_yes = std::true_type; /* a step's products: issued (at compile time) */
using fw_no = std::false_type;

/* The start of step u of a walk over S buffers: tile u has landed and every thread is done
 * with tile u - 2 (its buffer is refilled next). */
template <int S> static __device__ __forceinline__ void fw_step_start(void)
{
    fm_wait_group<S - 3>(); /* the groups after tile u's: tiles u + 1 .. u + S - 3 */
    fw_proxy_fence();
    __syncthreads();
}

/* fw_stage_kv's default `also`: nothing else in the group */
struct fw_nothing {
    __device__ void operator()(int) const {}
};

/* Tile u (rows r0 + 64 u .. r0 + 64 u + 63) of k and v, and what also(u) copies: one
 * cp.async group, empty past the last tile (nt - 1). K into buffer u % SK of KS bytes from
 * Kb, V into buffer u % SV of VS bytes from Vb (the forward: both in S buffers of a K and
 * V pair; dq: K in S, V in S - 1; dk/dv: Q and dO as the forward's K and V, from row j0,
 * and their statistics). */
template <int NT, int SK, int SV, unsigned KS, unsigned VS, class A = fw_nothing>
static __device__ __forceinline__ void fw_stage_kv(unsigned Kb, unsigned Vb, const fw_walk &k,
                                                   const fw_walk &v, int u, int nt, int T,
                                                   int r0 = 0, A also = A())
{
    if (u < nt) {
        fw_stage_walk<NT>(Kb + (u % SK) * KS, k, r0 + 64 * u, T);
        fw_stage_walk<NT>(Vb + (u % SV) * VS, v, r0 + 64 * u, T);
        also(u);
    }
    fm_commit();
}

/* out, lse as attention.cu's forward, from 16-bit q, k, v (B, T, H, 64); sl2 = log2(e) /
 * 8. A block of NWG warpgroups takes 64 NWG queries and walks the key tiles up to its
 * last. grid (B*H, query blocks), the longest (last queries) first. o16: out holds T16
 * values. */
template <class T16, int NWG>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 4 : 2)
    fw_forward_kernel(real *out, real *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                      int T, int H, float sl2, int o16)
{
#if FW_SKIP
    __trap();
#else
    constexpr int NT = 128 * NWG, S = FW_STAGES;
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const unsigned KV = sm0 + NWG * FW_TILE; /* buffer t: K at KV + 2 t FW_TILE, V after it */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = NWG == 1 ? 0 : warp >> 2, wq = warp & 3; /* NWG 1: a constant */
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64 * NWG;
    const int g0 = q0 + 64 * wg, first = g0 + 16 * wq;
    const int row[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
    const int nt = (min(T, q0 + 64 * NWG) + 63) / 64; /* every warpgroup walks them all */
    const fw_walk kw = fw_walk_at<NT>(k + base, ld), vw = fw_walk_at<NT>(v + base, ld);
    auto stage = [&](int u) {
        fw_stage_kv<NT, S, S, 2 * FW_TILE, 2 * FW_TILE>(KV, KV + FW_TILE, kw, vw, u, nt, T);
    };
#pragma unroll
    for (int t = 0; t < NWG; t++)
        fw_stage<NT>(sm0 + t * FW_TILE, q + base, ld, q0 + 64 * t, T);
#pragma unroll
    for (int u = 0; u < S - 2; u++)
        stage(u); /* the queries land with tile 0 */
    const unsigned Qw = sm0 + wg * FW_TILE;
    float o[32], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, corr[2] = {0.f, 0.f};
    unsigned pa[4][4]; /* tile u - 1's P: A of its P V */
#pragma unroll
    for (int i = 0; i < 32; i++)
        o[i] = 0.f;
    /* step u: tile u's S (HS) and tile u - 1's P V (HP) */
    auto step = [&](int u, auto hs, auto hp) {
        constexpr bool HS = decltype(hs)::value, HP = decltype(hp)::value;
        fw_step_start<S>();
        stage(u + S - 2);
        float s[32];
        if constexpr (HS) {
#pragma unroll
            for (int i = 0; i < 32; i++)
                s[i] = 0.f;
            fw_keep(s);
        }
        if constexpr (HP) {
            fw_keep(o);
            fw_keep_a(pa);
        }
        fw_fence();
        if constexpr (HS) {
            fw_products_ss<T16>(s, Qw, KV + 2 * (u % S) * FW_TILE); /* S = Q K^T */
            fw_commit();
        }
        if constexpr (HP) {
            fw_products_rs<T16>(o, pa, KV + (2 * ((u - 1) % S) + 1) * FW_TILE); /* O += P V */
            fw_commit();
        }
        if constexpr (HS) {
            if constexpr (HP)
                fw_wait<1>();
            else
                fw_wait<0>();
            fw_keep(s);
            const int j0 = 64 * u;
            float mx[2] = {-INFINITY, -INFINITY}, sum[2] = {0.f, 0.f};
            fm_each(
                j0 + 64 <= first,
                [&](int n, int e) {
                    const int j = j0 + 8 * n + 2 * quad + (e & 1);
                    return j <= row[e >> 1] && j < T;
                },
                [&](int n, int e, bool keep) {
                    float &x = s[4 * n + e];
                    x = keep ? x * sl2 : -INFINITY;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                });
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 2));
                const float mnew = fmaxf(m[r], mx[r]);
                corr[r] = fm_exp2(m[r] - mnew);
                m[r] = mnew;
            }
#pragma unroll
            for (int i = 0; i < 32; i++) {
                s[i] = fm_exp2(s[i] - m[(i >> 1) & 1]);
                sum[(i >> 1) & 1] += s[i];
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
                l[r] = l[r] * corr[r] + sum[r];
        }
        if constexpr (HP) {
            fw_wait<0>();
            fw_keep(o);
            fw_keep_a(pa);
        }
        if constexpr (HS) {
#pragma unroll
            for (int i = 0; i < 32; i++)
                o[i] *= corr[(i >> 1) & 1];
            fw_pack_a<T16>(pa, s);
        }
    };
    step(0, fw_yes(), fw_no());
    for (int u = 1; u < nt; u++)
        step(u, fw_yes(), fw_yes());
    step(nt, fw_no(), fw_yes());
    fw_forward_finish<T16>(out, lse, o, m, l, row, base, ld, bh, T, quad, o16);
#endif
}

/* attention_backward_qkv's outputs (y non-NULL): dq, dk and dv go straight into the rows
 * of [dq | dk | dv] (y, ldy elements apart, 16-bit), dq and dk rotated back by rope as
 * rope_backward_qkv does (cos_t, sin_t: (T, 32) tables). Each value is first rounded to
 * 16 bits as the separate store writes it, widened, rotated with the same roundings (no
 * contraction) and rounded again: the bits of the separate kernels. */
typedef struct {
    uint16_t *y;
    size_t ldy;
    const real *cos_t, *sin_t;
} fw_rope;

/* The rope tables' values for the lane's 2 rows (row0 + lane / 4, + 8; none past T) and
 * its columns 8 n + 2 (lane % 4) + {0, 1}, n < 4: loaded where the products still run, so
 * that the store does not wait for them. */
static __device__ __forceinline__ void fw_rope_load(const fw_rope &rp, int row0, int T, int lane,
                                                    float2 (&cs)[2][4], float2 (&sn)[2][4])
{
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + (lane >> 2) + 8 * r;
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const size_t at = (size_t)row * 32 + 8 * n + 2 * (lane & 3);
            cs[r][n] = row < T ? *(const float2 *)(rp.cos_t + at) : make_float2(0.f, 0.f);
            sn[r][n] = row < T ? *(const float2 *)(rp.sin_t + at) : make_float2(0.f, 0.f);
        }
    }
}

/* Rows [r0, r0 + 64) of the rope tables (cos, then sin: 64 x 32 floats each, 16 KB in
 * all) into shared memory at dst by cp.async of 16 bytes, zero past T; NT threads, in the
 * caller's group. */
template <int NT>
static __device__ __forceinline__ void fw_stage_tables(unsigned dst, const fw_rope &rp, int r0,
                                                       int T)
{
    for (int e = threadIdx.x; e < 2 * 64 * 8; e += NT) {
        const int t = e >> 9, r = (e >> 3) & 63, c = e & 7, row = r0 + r, in = row < T;
        const real *tab = t ? rp.sin_t : rp.cos_t;
        const real *s = in ? tab + (size_t)row * 32 + 4 * c : tab; /* 0 bytes read */
        const unsigned d = dst + (unsigned)(t * 64 * 32 * 4 + r * 128 + c * 16);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(s),
                     "r"(in ? 16 : 0));
    }
}

/* y from ybase (a head's first column of a sequence's first row) for the lane's 2 rows
 * (row0 + lane / 4, + 8) below T: mul * acc rounded, rotated back (the pairs i, i + 32 of
 * the head, which the accumulator layout gives one lane: n and n + 4) with the tables'
 * values (PRE: cs, sn from fw_rope_load; else loaded here from ct, st: tables whose row
 * 0 is row trow0, in shared or global memory), rounded. */
template <class T16, bool PRE>
static __device__ __forceinline__ void
fw_store_rope(const fw_rope &rp, size_t ybase, int row0, int T, float mul, const float (&acc)[8][4],
              int lane, const float2 (&cs)[2][4], const float2 (&sn)[2][4], const float *ct,
              const float *st, int trow0)
{
    constexpr int BF = std::is_same<T16, __nv_bfloat16>::value;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row0 + (lane >> 2) + 8 * r;
        if (row >= T)
            continue;
        uint16_t *out = rp.y + ybase + (size_t)row * rp.ldy;
#pragma unroll
        for (int n = 0; n < 4; n++) {
            const int c = 8 * n + 2 * (lane & 3);
            const unsigned pa = fm_pack<T16>(mul * acc[n][2 * r], mul * acc[n][2 * r + 1]);
            const unsigned pb = fm_pack<T16>(mul * acc[n + 4][2 * r], mul * acc[n + 4][2 * r + 1]);
            const float a[2] = {moe_widen16((uint16_t)(pa & 0xffffu), BF),
                                moe_widen16((uint16_t)(pa >> 16), BF)};
            const float b[2] = {moe_widen16((uint16_t)(pb & 0xffffu), BF),
                                moe_widen16((uint16_t)(pb >> 16), BF)};
            const size_t at = (size_t)(row - trow0) * 32 + c;
            const float2 tc = PRE ? cs[r][n] : *(const float2 *)(ct + at);
            const float2 ts = PRE ? sn[r][n] : *(const float2 *)(st + at);
            const float co[2] = {tc.x, tc.y}, si[2] = {-ts.x, -ts.y}; /* the inverse: -sin */
            uint16_t ya[2], yb[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                ya[e] = moe_round16(__fsub_rn(__fmul_rn(a[e], co[e]), __fmul_rn(b[e], si[e])), BF);
                yb[e] = moe_round16(__fadd_rn(__fmul_rn(b[e], co[e]), __fmul_rn(a[e], si[e])), BF);
            }
            *(unsigned *)(out + c) = ya[0] | (unsigned)ya[1] << 16;
            *(unsigned *)(out + c + 32) = yb[0] | (unsigned)yb[1] << 16;
        }
    }
}

/* dq = scale * sum_{j <= i} ds_ij k_j, as attention.cu's fm_dq_kernel: a block of NWG
 * warpgroups takes 64 NWG queries and walks the key tiles up to its last query;
 * per tile S = Q K^T and dP = dO V^T (A and B both from shared memory), dS = P (dP - D)
 * in registers, dQ += dS K (K read MN-major). grid (B*H, query blocks), the longest
 * first. dq16: dq holds T16 values. */
template <class T16, int NWG>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 3 : 1)
    fw_dq_kernel(real *dq, const uint16_t *dout, const real *lse, const float *dsum,
                 const uint16_t *q, const uint16_t *k, const uint16_t *v, int T, int H, float scale,
                 float sl2, int dq16, fw_rope rp)
{
#if FW_SKIP
    __trap();
#else
    constexpr int NT = 128 * NWG, S = FW_STAGES;
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = NWG == 1 ? 0 : warp >> 2, wq = warp & 3; /* NWG 1: a constant */
    /* Q (a tile a warpgroup), dO (likewise), then the buffers: S of K, S - 1 of V */
    const unsigned Qs = sm0 + wg * FW_TILE, Gs = sm0 + (NWG + wg) * FW_TILE;
    const unsigned Kb = sm0 + 2 * NWG * FW_TILE, Vb = Kb + S * FW_TILE;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64 * NWG;
    const int g0 = q0 + 64 * wg, first = g0 + 16 * wq;
    const int row[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
    const int nt = (min(T, q0 + 64 * NWG) + 63) / 64; /* every warpgroup walks them all */
    const fw_walk kw = fw_walk_at<NT>(k + base, ld), vw = fw_walk_at<NT>(v + base, ld);
    auto stage = [&](int u) {
        fw_stage_kv<NT, S, S - 1, FW_TILE, FW_TILE>(Kb, Vb, kw, vw, u, nt, T);
    };
#pragma unroll
    for (int t = 0; t < NWG; t++) {
        fw_stage<NT>(sm0 + t * FW_TILE, q + base, ld, q0 + 64 * t, T);
        fw_stage<NT>(sm0 + (NWG + t) * FW_TILE, dout + base, ld, q0 + 64 * t, T);
    }
#pragma unroll
    for (int u = 0; u < S - 2; u++)
        stage(u);
    float lse2[2], Di[2];
    fm_row_stats(lse2, Di, lse, dsum, bh, T, row);
    float acc[32];
    float2 tcs[2][4], tsn[2][4]; /* the rope tables' values for the store (rp.y) */
    unsigned da[4][4];           /* tile u - 1's dS: A of its dS K */
#pragma unroll
    for (int i = 0; i < 32; i++)
        acc[i] = 0.f;
    /* step u: tile u's S and dP (HS) and tile u - 1's dS K (HP) */
    auto step = [&](int u, auto hs, auto hp) {
        constexpr bool HS = decltype(hs)::value, HP = decltype(hp)::value;
        fw_step_start<S>();
        stage(u + S - 2);
        float p[32], dp[32];
        if constexpr (HS) {
#pragma unroll
            for (int i = 0; i < 32; i++)
                p[i] = dp[i] = 0.f;
            fw_keep(p);
            fw_keep(dp);
        }
        if constexpr (HP) {
            fw_keep(acc);
            fw_keep_a(da);
        }
        fw_fence();
        if constexpr (HS) {
            fw_products_ss<T16>(p, Qs, Kb + (u % S) * FW_TILE);        /* S = Q K^T */
            fw_products_ss<T16>(dp, Gs, Vb + (u % (S - 1)) * FW_TILE); /* dP = dO V^T */
            fw_commit();
        }
        if constexpr (HP) {
            fw_products_rs<T16>(acc, da, Kb + ((u - 1) % S) * FW_TILE); /* dQ += dS K */
            fw_commit();
        }
        if constexpr (!HS) /* the last step: the store's tables, while dS K runs */
            if (rp.y)
                fw_rope_load(rp, first, T, lane, tcs, tsn);
        if constexpr (HS) {
            if constexpr (HP)
                fw_wait<1>();
            else
                fw_wait<0>();
            fw_keep(p);
            fw_keep(dp);
            const int j0 = 64 * u;
            fm_each(
                j0 + 64 <= first && first + 16 <= T,
                [&](int n, int e) {
                    return j0 + 8 * n + 2 * quad + (e & 1) <= row[e >> 1] && row[e >> 1] < T;
                },
                [&](int n, int e, bool keep) {
                    const int i = 4 * n + e, r = e >> 1;
                    p[i] = keep ? fm_exp2(p[i] * sl2 - lse2[r]) * (dp[i] - Di[r]) : 0.f;
                });
        }
        if constexpr (HP) {
            fw_wait<0>();
            fw_keep(acc);
            fw_keep_a(da);
        }
        if constexpr (HS)
            fw_pack_a<T16>(da, p);
    };
    step(0, fw_yes(), fw_no());
    for (int u = 1; u < nt; u++)
        step(u, fw_yes(), fw_yes());
    step(nt, fw_no(), fw_yes());
    if (rp.y) /* part 0 of [dq | dk | dv] */
        fw_store_rope<T16, true>(rp, (size_t)b * T * rp.ldy + (size_t)h * 64, first, T, scale,
                                 *reinterpret_cast<const float(*)[8][4]>(&acc), lane, tcs, tsn,
                                 NULL, NULL, 0);
    else
        fm_store_rows<T16, 64>(dq, base, ld, first, T, 64, scale,
                               *reinterpret_cast<const float(*)[8][4]>(&acc), lane, dq16);
#endif
}

/* dk = scale * sum_{i >= j} ds_ij q_i, dv = sum_{i >= j} p_ij dout_i, as attention.cu's
 * fm_dkv_kernel: a block of NWG warpgroups takes 64 NWG keys (each 64) and walks the
 * query tiles from its first key on; per tile S^T = K Q^T and dP^T = V dO^T (A and B
 * from shared memory), P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q (dO, Q
 * read MN-major). The Q, dO tiles and their row statistics sit in S buffers, tile u + S - 1
 * copied from step u on (S = 2: double-buffered). grid (B*H, key blocks), the longest
 * (first keys) first. dk or dv may be NULL. */
template <class T16, int NWG, int S>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 3 : 1)
    fw_dkv_kernel(real *dk, real *dv, const uint16_t *dout, const real *lse, const float *dsum,
                  const uint16_t *q, const uint16_t *k, const uint16_t *v, int T, int H,
                  float scale, float sl2, int dk16, int dv16, fw_rope rp)
{
#if FW_SKIP
    __trap();
#else
    constexpr int NT = 128 * NWG;
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = NWG == 1 ? 0 : warp >> 2, wq = warp & 3; /* NWG 1: a constant */
    /* K (a tile a warpgroup), V (likewise), the buffers (Q, dO each), their statistics */
    const unsigned Ks = sm0 + wg * FW_TILE, Vs = sm0 + (NWG + wg) * FW_TILE;
    const unsigned QG = sm0 + 2 * NWG * FW_TILE;
    /* the statistics as copied (lse, then dsum, 64 each, a buffer): read through st */
    const unsigned St = QG + 2 * S * FW_TILE;
    const float *st = (const float *)(fw_sm + (St - (unsigned)__cvta_generic_to_shared(fw_sm)));
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int j0 = blockIdx.y * 64 * NWG, g0 = j0 + 64 * wg, first = g0 + 16 * wq;
    const int key[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
    const int nt = (T - j0 + 63) / 64; /* query tiles from j0 on */
    const fw_walk qw = fw_walk_at<NT>(q + base, ld), gw = fw_walk_at<NT>(dout + base, ld);
    /* tile u's Q, dO and their statistics: one group, empty past the last tile */
    auto stats = [&](int u) { fw_stage_stats(St + 512 * (u % S), lse, dsum, bh, T, j0 + 64 * u); };
    auto stage = [&](int u) {
        fw_stage_kv<NT, S, S, 2 * FW_TILE, 2 * FW_TILE>(QG, QG + FW_TILE, qw, gw, u, nt, T, j0,
                                                        stats);
    };
#pragma unroll
    for (int t = 0; t < NWG; t++) {
        fw_stage<NT>(sm0 + t * FW_TILE, k + base, ld, j0 + 64 * t, T);
        fw_stage<NT>(sm0 + (NWG + t) * FW_TILE, v + base, ld, j0 + 64 * t, T);
    }
#pragma unroll
    for (int u = 0; u < S - 1; u++)
        stage(u); /* the keys and values land with tile 0 */
    float dka[32], dva[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
        dka[i] = dva[i] = 0.f;
    for (int u = 0; u < nt; u++) {
        fm_wait_group<S - 2>(); /* tile u has landed */
        fw_proxy_fence();
        __syncthreads(); /* and every thread is done with tile u - 1, whose buffer: */
        if constexpr (NWG == 1)
            if (rp.y && u == nt - 1) /* the store's tables, into the buffer no tile fills */
                fw_stage_tables<NT>(QG + 2 * (nt % S) * FW_TILE, rp, j0, T);
        stage(u + S - 1);
        const int i0 = j0 + 64 * u;
        const unsigned Qt = QG + 2 * (u % S) * FW_TILE, Gt = Qt + FW_TILE;
        const float *ls = st + 128 * (u % S), *Ds = ls + 64;
        if (NWG == 1 || i0 + 63 >= g0) { /* else every query is before its keys */
            float p[32], dp[32];
            fw_scores2<T16>(p, Ks, Qt, dp, Vs, Gt); /* S^T, dP^T */
            fm_each(
                i0 >= first + 16 && i0 + 64 <= T, /* every query after every key of the warp */
                [&](int n, int e) {
                    const int i = i0 + 8 * n + 2 * quad + (e & 1), j = key[e >> 1];
                    return i >= j && i < T && j < T;
                },
                [&](int n, int e, bool keep) {
                    const int x = 4 * n + e, col = 8 * n + 2 * quad + (e & 1);
                    p[x] = keep ? fm_exp2(p[x] * sl2 - __fmul_rn(ls[col], FA_LOG2E)) : 0.f;
                    dp[x] = p[x] * (dp[x] - Ds[col]); /* dS^T */
                });
            unsigned pa[4][4], da[4][4];
            fw_pack_a<T16>(pa, p);
            fw_pack_a<T16>(da, dp);
            fw_keep(dva);
            fw_keep(dka);
            fw_keep_a(pa);
            fw_keep_a(da);
            fw_fence();
            fw_products_rs<T16>(dva, pa, Gt); /* dV += P^T dO */
            fw_products_rs<T16>(dka, da, Qt); /* dK += dS^T Q */
            fw_commit_wait();
            fw_keep(dva);
            fw_keep(dka);
            fw_keep_a(pa);
            fw_keep_a(da);
        }
    }
    if (rp.y) { /* parts 1 (dk, rotated back) and 2 (dv, as it is) of [dq | dk | dv] */
        const size_t yb = (size_t)b * T * rp.ldy + (size_t)h * 64, D = (size_t)H * 64;
        fm_store_rows<T16, 64>((real *)rp.y, yb + 2 * D, rp.ldy, first, T, 64, 1.f,
                               *reinterpret_cast<const float(*)[8][4]>(&dva), lane, 1);
        /* the tables read by the store: into registers during the last products, or before
         * dv's store, they spill (168 registers a thread); a block of one warpgroup has them
         * in shared memory (copied during its last tile), else they are read from global */
        float2 tcs[2][4], tsn[2][4];
        if constexpr (NWG == 1) {
            fm_wait_all();
            __syncthreads();
            const float *tab = (const float *)(fw_sm + (QG + 2 * (nt % S) * FW_TILE -
                                                        (unsigned)__cvta_generic_to_shared(fw_sm)));
            fw_store_rope<T16, false>(rp, yb + D, first, T, scale,
                                      *reinterpret_cast<const float(*)[8][4]>(&dka), lane, tcs, tsn,
                                      tab, tab + 64 * 32, j0);
        } else {
            fw_store_rope<T16, false>(rp, yb + D, first, T, scale,
                                      *reinterpret_cast<const float(*)[8][4]>(&dka), lane, tcs, tsn,
                                      rp.cos_t, rp.sin_t, 0);
        }
    } else {
        fm_store_rows<T16, 64>(dv, base, ld, first, T, 64, 1.f,
                               *reinterpret_cast<const float(*)[8][4]>(&dva), lane, dv16);
        fm_store_rows<T16, 64>(dk, base, ld, first, T, 64, scale,
                               *reinterpret_cast<const float(*)[8][4]>(&dka), lane, dk16);
    }
#endif
}

/* Shared memory of the backward kernels: dq 2 NWG fixed tiles + 2 FW_STAGES - 1 walked
 * ones (73 KiB for one warpgroup, 3 blocks an SM); dk/dv 2 NWG fixed ones + 2 S walked ones
 * and their statistics (S x 128 floats). */
#define FW_DQ_SMEM(NWG) ((2 * (NWG) + 2 * FW_STAGES - 1) * FW_TILE + 1024)
#define FW_DKV_SMEM(NWG, S) ((2 * (NWG) + 2 * (S)) * FW_TILE + (S)*128 * 4 + 1024)

/* Lets kernel take smem bytes of dynamic shared memory, once per kernel (ready its flag);
 * 0 (recorded) on failure. */
static int fw_smem(const void *kernel, size_t smem, int *ready)
{
    if (*ready)
        return 1;
    if (!MOE_CUDA_OK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem)))
        return 0;
    *ready = 1;
    return 1;
}

/* The instantiation of kernel for the 16-bit type (bf16) and the warpgroups (nwg). */
#define FW_PICK(kernel, bf16, nwg)                                                                 \
    ((nwg) == 1 ? ((bf16) ? kernel<__nv_bfloat16, 1> : kernel<__half, 1>)                          \
                : ((bf16) ? kernel<__nv_bfloat16, 2> : kernel<__half, 2>))

/* The forward (attention_wgmma.h). */
extern "C" int cuda_wgmma_attention_forward(int bf16, real *out, real *lse, const uint16_t *q,
                                            const uint16_t *k, const uint16_t *v, int B, int T,
                                            int H, int o16, int wg)
{
    const int nwg = wg == 1 ? 1 : 2;
    void (*fw_forward)(real *, real *, const uint16_t *, const uint16_t *, const uint16_t *, int,
                       int, float, int) = FW_PICK(fw_forward_kernel, bf16, nwg);
    static int ready[2][3];
    const size_t smem = FW_SMEM(nwg);
    if (!fw_smem((const void *)fw_forward, smem, &ready[bf16][nwg]))
        return 0;
    const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
    const float sl2 = (float)(1.4426950408889634 / 8.0); /* log2(e) / sqrt(64) */
    MOE_CUDA_LAUNCH(fw_forward, grid, 128 * nwg, smem, out, lse, q, k, v, T, H, sl2, o16);
    return 1;
}

/* The backward (attention_wgmma.h). */
extern "C" int cuda_wgmma_attention_backward(int bf16, real *dq, real *dk, real *dv,
                                             const uint16_t *dout, const real *lse,
                                             const float *dsum, const uint16_t *q,
                                             const uint16_t *k, const uint16_t *v, int B, int T,
                                             int H, int dq16, int dk16, int dv16, int dq_wg,
                                             int dkv_wg, int dkv_stages, uint16_t *dqkv,
                                             const real *cos_t, const real *sin_t)
{
    const fw_rope rp = {dqkv, (size_t)3 * H * 64, cos_t, sin_t};
    const float scale = 0.125f, sl2 = (float)(1.4426950408889634 / 8.0); /* 1 / sqrt(64) */
    static int ready[2][3][3]; /* [bf16][0: dq, 1, 2: dk/dv of 2, 3 stages][nwg] */
    if (dq) {
        const int nwg = dq_wg == 1 ? 1 : 2;
        void (*fw_dq)(real *, const uint16_t *, const real *, const float *, const uint16_t *,
                      const uint16_t *, const uint16_t *, int, int, float, float, int, fw_rope) =
            FW_PICK(fw_dq_kernel, bf16, nwg);
        const size_t smem = FW_DQ_SMEM(nwg);
        if (!fw_smem((const void *)fw_dq, smem, &ready[bf16][0][nwg]))
            return 0;
        const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
        MOE_CUDA_LAUNCH(fw_dq, grid, 128 * nwg, smem, dq, dout, lse, dsum, q, k, v, T, H, scale,
                        sl2, dq16, rp);
    }
    if (dk || dv) {
        const int nwg = dkv_wg == 1 ? 1 : 2, ns = dkv_stages == 3 ? 3 : 2;
        void (*fw_dkv)(real *, real *, const uint16_t *, const real *, const float *,
                       const uint16_t *, const uint16_t *, const uint16_t *, int, int, float, float,
                       int, int, fw_rope) =
            ns == 3
                ? (nwg == 1
                       ? (bf16 ? fw_dkv_kernel<__nv_bfloat16, 1, 3> : fw_dkv_kernel<__half, 1, 3>)
                       : (bf16 ? fw_dkv_kernel<__nv_bfloat16, 2, 3> : fw_dkv_kernel<__half, 2, 3>))
                : (nwg == 1
                       ? (bf16 ? fw_dkv_kernel<__nv_bfloat16, 1, 2> : fw_dkv_kernel<__half, 1, 2>)
                       : (bf16 ? fw_dkv_kernel<__nv_bfloat16, 2, 2> : fw_dkv_kernel<__half, 2, 2>));
        const size_t smem = FW_DKV_SMEM(nwg, ns);
        if (!fw_smem((const void *)fw_dkv, smem, &ready[bf16][ns - 1][nwg]))
            return 0;
        const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
        MOE_CUDA_LAUNCH(fw_dkv, grid, 128 * nwg, smem, dk, dv, dout, lse, dsum, q, k, v, T, H,
                        scale, sl2, dk16, dv16, rp);
    }
    return 1;
}
