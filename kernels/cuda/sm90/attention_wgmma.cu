/* kernels/cuda/sm90/attention_wgmma.cu: the causal attention forward on Hopper's
 * warpgroup MMA (wgmma, sm_90a), for head dim 64 in bf16 / fp16 precision; attention.cu
 * takes it on compute capability 9.0 (its mma.sync kernel elsewhere, or with
 * MOE_ATTENTION=mma).
 *
 * The same walk, online softmax, outputs and lse as fm_forward_kernel (attention.cu), but
 * a block of 2 warpgroups takes 128 queries, each warpgroup 64: per 64-key tile it forms
 * S = Q K^T (64 x 64) with 4 wgmma of k = 16 (A: the warpgroup's Q tile, B: the K tile,
 * both in shared memory, K-major) and O += P V with 4 more (A: the probabilities, rounded
 * in pairs from S's accumulators, whose layout is wgmma's register A; B: the V tile,
 * MN-major). A warpgroup reads each B tile once, where mma.sync's warps each load it
 * through ldmatrix (four times the shared-memory traffic). Tiles arrive by cp.async into
 * two buffers, the next tile's copy running while the current is used; sm90/wgmma.cuh
 * has the layouts. Sums are in a fixed order: deterministic. (Q's A operand taken into
 * registers by ldmatrix, as mma.sync's kernels do, gave wrong outputs past one key tile
 * on the H200, although a one-tile probe of the same helpers was exact; from shared
 * memory, as the backward's kernels take theirs, it is right.) */
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/cuda_common.cuh"

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/sm90/wgmma.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define FW_SKIP 1 /* never: CMakeLists.txt builds this file for sm_90a alone */
#else
#define FW_SKIP 0
#endif

/* Q (a tile a warpgroup), K0, V0, K1, V1, and room to align the start to 1024 bytes */
#define FW_SMEM(NWG) (((NWG) + 4) * FW_TILE + 1024)

/* out, lse as attention.cu's forward, from 16-bit q, k, v (B, T, H, 64); sl2 = log2(e) /
 * 8. grid (B*H, query blocks of 128), the longest (last queries) first. o16: out holds
 * T16 values. */
template <class T16, int NWG>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 4 : 2)
    fw_forward_kernel(real *out, real *lse, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                      int T, int H, float sl2, int o16)
{
#if FW_SKIP
    __trap();
#else
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const unsigned Qs = sm0, KV = sm0 + NWG * FW_TILE; /* KV: K0, V0, K1, V1 */
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64 * NWG;
    const int g0 = q0 + 64 * wg, first = g0 + 16 * wq; /* the warpgroup's, the warp's */
    const int row[2] = {first + (lane >> 2), first + (lane >> 2) + 8}; /* the lane's */
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
#pragma unroll
    for (int t = 0; t < NWG; t++)
        fw_stage<128 * NWG>(Qs + t * FW_TILE, q + base, ld, q0 + 64 * t, T);
    fw_stage<128 * NWG>(KV, k + base, ld, 0, T);
    fw_stage<128 * NWG>(KV + FW_TILE, v + base, ld, 0, T);
    fm_commit();
    fm_wait_all();
    fw_proxy_fence();
    __syncthreads();
    const unsigned Qw = Qs + wg * FW_TILE; /* the warpgroup's queries */
    float o[32], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 32; i++)
        o[i] = 0.f;
    const int kend = min(T, q0 + 64 * NWG);
    for (int j0 = 0, tb = 0; j0 < kend; j0 += 64, tb ^= 1) {
        const unsigned Ks = KV + 2 * tb * FW_TILE, Vs = Ks + FW_TILE;
        if (j0 + 64 < kend) { /* the next tile into the other buffer */
            const unsigned nk = KV + 2 * (tb ^ 1) * FW_TILE;
            fw_stage<128 * NWG>(nk, k + base, ld, j0 + 64, T);
            fw_stage<128 * NWG>(nk + FW_TILE, v + base, ld, j0 + 64, T);
            fm_commit();
        }
        if (j0 <= g0 + 63) { /* warpgroup-uniform: else every key is after its rows */
            float s[32];
#pragma unroll
            for (int i = 0; i < 32; i++)
                s[i] = 0.f;
            fw_keep(s);
            fw_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                fw_mma_s<T16, 0>(s, fw_desc(Qw + 32 * kk), fw_desc(Ks + 32 * kk));
            fw_commit_wait();
            fw_keep(s);
            /* tile 0 holds key 0, which every row keeps: m is finite from it on, and a
             * later tile wholly after a warp's rows leaves its m and l as they are */
            float mx[2] = {-INFINITY, -INFINITY};
            fm_each(
                j0 + 64 <= first, /* every key before every row of the warp */
                [&](int n, int e) {
                    const int j = j0 + 8 * n + 2 * quad + (e & 1);
                    return j <= row[e >> 1] && j < T;
                },
                [&](int n, int e, bool keep) {
                    float &x = s[4 * n + e];
                    x = keep ? x * sl2 : -INFINITY;
                    mx[e >> 1] = fmaxf(mx[e >> 1], x);
                });
            float corr[2], sum[2] = {0.f, 0.f};
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 2));
                const float mnew = fmaxf(m[r], mx[r]);
                corr[r] = fm_exp2(m[r] - mnew); /* 0 on the first tile */
                m[r] = mnew;
            }
#pragma unroll
            for (int i = 0; i < 32; i++) {
                s[i] = fm_exp2(s[i] - m[(i >> 1) & 1]); /* exp2(-inf) = 0 */
                sum[(i >> 1) & 1] += s[i];
            }
#pragma unroll
            for (int r = 0; r < 2; r++)
                l[r] = l[r] * corr[r] + sum[r]; /* the lane's share */
#pragma unroll
            for (int i = 0; i < 32; i++)
                o[i] *= corr[(i >> 1) & 1];
            fw_mma_rs<T16>(o, s, Vs); /* O += P V */
        }
        fm_wait_all();
        fw_proxy_fence();
        __syncthreads(); /* this tile is used up, the next one is in */
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[r], 2);
        if (row[r] >= T)
            continue;
        const float inv = 1.f / l[r];
        const size_t orow = base + (size_t)row[r] * ld + 2 * quad; /* o16: T16 */
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
#endif
}

/* dq = scale * sum_{j <= i} ds_ij k_j, as attention.cu's fm_dq_kernel: a block of 2
 * warpgroups takes 128 queries (each 64) and walks the key tiles up to its last query;
 * per tile S = Q K^T and dP = dO V^T (A and B both from shared memory), dS = P (dP - D)
 * in registers, dQ += dS K (K read MN-major). grid (B*H, query blocks), the longest
 * first. dq16: dq holds T16 values. */
template <class T16, int NWG>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 4 : 2)
    fw_dq_kernel(real *dq, const uint16_t *dout, const real *lse, const float *dsum,
                 const uint16_t *q, const uint16_t *k, const uint16_t *v, int T, int H, float scale,
                 float sl2, int dq16)
{
#if FW_SKIP
    __trap();
#else
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    /* Q (a tile a warpgroup), dO (likewise), K0, V0, K1, V1 */
    const unsigned Qs = sm0 + wg * FW_TILE, Gs = sm0 + (NWG + wg) * FW_TILE;
    const unsigned KV = sm0 + 2 * NWG * FW_TILE;
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * 64 * NWG;
    const int g0 = q0 + 64 * wg, first = g0 + 16 * wq;
    const int row[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
#pragma unroll
    for (int t = 0; t < NWG; t++) {
        fw_stage<128 * NWG>(sm0 + t * FW_TILE, q + base, ld, q0 + 64 * t, T);
        fw_stage<128 * NWG>(sm0 + (NWG + t) * FW_TILE, dout + base, ld, q0 + 64 * t, T);
    }
    fw_stage<128 * NWG>(KV, k + base, ld, 0, T);
    fw_stage<128 * NWG>(KV + FW_TILE, v + base, ld, 0, T);
    fm_commit();
    float lse2[2], Di[2];
    fm_row_stats(lse2, Di, lse, dsum, bh, T, row);
    fm_wait_all();
    fw_proxy_fence();
    __syncthreads();
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
        acc[i] = 0.f;
    const int kend = min(T, q0 + 64 * NWG);
    for (int j0 = 0, tb = 0; j0 < kend; j0 += 64, tb ^= 1) {
        const unsigned Ks = KV + 2 * tb * FW_TILE, Vs = Ks + FW_TILE;
        if (j0 + 64 < kend) {
            const unsigned nk = KV + 2 * (tb ^ 1) * FW_TILE;
            fw_stage<128 * NWG>(nk, k + base, ld, j0 + 64, T);
            fw_stage<128 * NWG>(nk + FW_TILE, v + base, ld, j0 + 64, T);
            fm_commit();
        }
        if (j0 <= g0 + 63) { /* warpgroup-uniform */
            float p[32], dp[32];
            fw_scores2<T16>(p, Qs, Ks, dp, Gs, Vs); /* S, dP */
            fm_each(
                j0 + 64 <= first && first + 16 <= T, /* no key after a row of the warp */
                [&](int n, int e) {
                    return j0 + 8 * n + 2 * quad + (e & 1) <= row[e >> 1] && row[e >> 1] < T;
                },
                [&](int n, int e, bool keep) {
                    const int i = 4 * n + e, r = e >> 1;
                    p[i] = keep ? fm_exp2(p[i] * sl2 - lse2[r]) * (dp[i] - Di[r]) : 0.f; /* dS */
                });
            fw_mma_rs<T16>(acc, p, Ks); /* dQ += dS K */
        }
        fm_wait_all();
        fw_proxy_fence();
        __syncthreads();
    }
    fm_store_rows<T16, 64>(dq, base, ld, first, T, 64, scale,
                           *reinterpret_cast<const float(*)[8][4]>(&acc), lane, dq16);
#endif
}

/* dk = scale * sum_{i >= j} ds_ij q_i, dv = sum_{i >= j} p_ij dout_i, as attention.cu's
 * fm_dkv_kernel: a block of NWG warpgroups takes 64 NWG keys (each 64) and walks the
 * query tiles from its first key on; per tile S^T = K Q^T and dP^T = V dO^T (A and B
 * from shared memory), P^T and dS^T in registers, dV += P^T dO and dK += dS^T Q (dO, Q
 * read MN-major). The Q, dO tiles and their row statistics are double-buffered. grid
 * (B*H, key blocks), the longest (first keys) first. dk or dv may be NULL. */
template <class T16, int NWG>
static __global__ void __launch_bounds__(128 * NWG, NWG == 1 ? 3 : 1)
    fw_dkv_kernel(real *dk, real *dv, const uint16_t *dout, const real *lse, const float *dsum,
                  const uint16_t *q, const uint16_t *k, const uint16_t *v, int T, int H,
                  float scale, float sl2, int dk16, int dv16)
{
#if FW_SKIP
    __trap();
#else
    constexpr int NT = 128 * NWG;
    extern __shared__ unsigned char fw_sm[];
    const unsigned sm0 = fw_align1024(fw_sm);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
    const int wg = warp >> 2, wq = warp & 3;
    /* K (a tile a warpgroup), V (likewise), Q0, G0, Q1, G1; then the statistics */
    const unsigned Ks = sm0 + wg * FW_TILE, Vs = sm0 + (NWG + wg) * FW_TILE;
    const unsigned QG = sm0 + 2 * NWG * FW_TILE;
    float *st = (float *)(fw_sm + (QG + 4 * FW_TILE - (unsigned)__cvta_generic_to_shared(fw_sm)));
    const int bh = blockIdx.x, b = bh / H, h = bh % H;
    const int j0 = blockIdx.y * 64 * NWG, g0 = j0 + 64 * wg, first = g0 + 16 * wq;
    const int key[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
    const size_t ld = (size_t)H * 64, base = (size_t)b * T * ld + (size_t)h * 64;
#pragma unroll
    for (int t = 0; t < NWG; t++) {
        fw_stage<NT>(sm0 + t * FW_TILE, k + base, ld, j0 + 64 * t, T);
        fw_stage<NT>(sm0 + (NWG + t) * FW_TILE, v + base, ld, j0 + 64 * t, T);
    }
    fw_stage<NT>(QG, q + base, ld, j0, T);
    fw_stage<NT>(QG + FW_TILE, dout + base, ld, j0, T);
    fm_commit();
    fm_stage_stats(st, lse, dsum, bh, T, j0);
    fm_wait_all();
    fw_proxy_fence();
    __syncthreads();
    float dka[32], dva[32];
#pragma unroll
    for (int i = 0; i < 32; i++)
        dka[i] = dva[i] = 0.f;
    for (int i0 = j0, t = 0; i0 < T; i0 += 64, t ^= 1) {
        const unsigned Qt = QG + 2 * t * FW_TILE, Gt = Qt + FW_TILE;
        const float *ls = st + 128 * t, *Ds = ls + 64;
        if (i0 + 64 < T) { /* the next query tile into the other buffer */
            const int n0 = i0 + 64;
            const unsigned nq = QG + 2 * (t ^ 1) * FW_TILE;
            fw_stage<NT>(nq, q + base, ld, n0, T);
            fw_stage<NT>(nq + FW_TILE, dout + base, ld, n0, T);
            fm_commit();
            fm_stage_stats(st + 128 * (t ^ 1), lse, dsum, bh, T, n0);
        }
        if (i0 + 63 >= g0) { /* warpgroup-uniform: else every query is before its keys */
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
                    p[x] = keep ? fm_exp2(p[x] * sl2 - ls[col]) : 0.f;
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
        fm_wait_all();
        fw_proxy_fence();
        __syncthreads();
    }
    fm_store_rows<T16, 64>(dv, base, ld, first, T, 64, 1.f,
                           *reinterpret_cast<const float(*)[8][4]>(&dva), lane, dv16);
    fm_store_rows<T16, 64>(dk, base, ld, first, T, 64, scale,
                           *reinterpret_cast<const float(*)[8][4]>(&dka), lane, dk16);
#endif
}

/* Shared memory of the backward kernels: dq 2 x 2 fixed tiles + 2 x 2 walked ones; dk/dv
 * 2 NWG fixed ones + 2 x 2 walked ones and their statistics (2 x 128 floats). */
#define FW_DQ_SMEM(NWG) ((2 * (NWG) + 4) * FW_TILE + 1024)
#define FW_DKV_SMEM(NWG) ((2 * (NWG) + 4) * FW_TILE + 2 * 128 * 4 + 1024)

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

/* The forward for head dim 64 from 16-bit q, k, v (16-byte aligned): bf16 or fp16 values;
 * wg warpgroups a block (1 or 2); 0 (recorded) when the kernel cannot take its shared
 * memory. Called by attention.cu on compute capability 9.0 only. */
extern "C" int cuda_wgmma_attention_forward(int bf16, real *out, real *lse, const uint16_t *q,
                                            const uint16_t *k, const uint16_t *v, int B, int T,
                                            int H, int o16, int wg)
{
    const int nwg = wg == 1 ? 1 : 2;
    void (*fw_forward)(real *, real *, const uint16_t *, const uint16_t *, const uint16_t *, int,
                       int, float, int) =
        nwg == 1 ? (bf16 ? fw_forward_kernel<__nv_bfloat16, 1> : fw_forward_kernel<__half, 1>)
                 : (bf16 ? fw_forward_kernel<__nv_bfloat16, 2> : fw_forward_kernel<__half, 2>);
    static int ready[2][3];
    const size_t smem = FW_SMEM(nwg);
    if (!fw_smem((const void *)fw_forward, smem, &ready[bf16][nwg]))
        return 0;
    const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
    const float sl2 = (float)(1.4426950408889634 / 8.0); /* log2(e) / sqrt(64) */
    MOE_CUDA_LAUNCH(fw_forward, grid, 128 * nwg, smem, out, lse, q, k, v, T, H, sl2, o16);
    return 1;
}

/* The backward for head dim 64 from 16-bit q, k, v and dout, after dsum (Di = dout_i .
 * out_i): dq if dq, dk and dv if either; dq_wg, dkv_wg warpgroups a block of each (1 or
 * 2). 0 (recorded) when a kernel cannot take its shared memory. */
extern "C" int cuda_wgmma_attention_backward(int bf16, real *dq, real *dk, real *dv,
                                             const uint16_t *dout, const real *lse,
                                             const float *dsum, const uint16_t *q,
                                             const uint16_t *k, const uint16_t *v, int B, int T,
                                             int H, int dq16, int dk16, int dv16, int dq_wg,
                                             int dkv_wg)
{
    const float scale = 0.125f, sl2 = (float)(1.4426950408889634 / 8.0); /* 1 / sqrt(64) */
    static int ready[2][2][3];
    if (dq) {
        const int nwg = dq_wg == 1 ? 1 : 2;
        void (*fw_dq)(real *, const uint16_t *, const real *, const float *, const uint16_t *,
                      const uint16_t *, const uint16_t *, int, int, float, float, int) =
            nwg == 1 ? (bf16 ? fw_dq_kernel<__nv_bfloat16, 1> : fw_dq_kernel<__half, 1>)
                     : (bf16 ? fw_dq_kernel<__nv_bfloat16, 2> : fw_dq_kernel<__half, 2>);
        const size_t smem = FW_DQ_SMEM(nwg);
        if (!fw_smem((const void *)fw_dq, smem, &ready[bf16][0][nwg]))
            return 0;
        const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
        MOE_CUDA_LAUNCH(fw_dq, grid, 128 * nwg, smem, dq, dout, lse, dsum, q, k, v, T, H, scale,
                        sl2, dq16);
    }
    if (dk || dv) {
        const int nwg = dkv_wg == 1 ? 1 : 2;
        void (*fw_dkv)(real *, real *, const uint16_t *, const real *, const float *,
                       const uint16_t *, const uint16_t *, const uint16_t *, int, int, float, float,
                       int, int) =
            nwg == 1 ? (bf16 ? fw_dkv_kernel<__nv_bfloat16, 1> : fw_dkv_kernel<__half, 1>)
                     : (bf16 ? fw_dkv_kernel<__nv_bfloat16, 2> : fw_dkv_kernel<__half, 2>);
        const size_t smem = FW_DKV_SMEM(nwg);
        if (!fw_smem((const void *)fw_dkv, smem, &ready[bf16][1][nwg]))
            return 0;
        const dim3 grid((unsigned)(B * H), (unsigned)((T + 64 * nwg - 1) / (64 * nwg)));
        MOE_CUDA_LAUNCH(fw_dkv, grid, 128 * nwg, smem, dk, dv, dout, lse, dsum, q, k, v, T, H,
                        scale, sl2, dk16, dv16);
    }
    return 1;
}
