/* kernels/cuda/attention.cu: fused causal multi-head attention, scale 1/sqrt(Hd), for
 * any T >= 1 and Hd <= 128. The T x T scores are never stored.
 *
 * Forward: a block holds ATT_WARPS consecutive queries of one (sequence, head), one per
 * warp, and walks the keys in tiles of 32 staged in shared memory; lane l scores key
 * j0 + l, the warp keeps a running max and sum (online softmax) and each lane
 * accumulates Hd/32 output dims. lse (B, H, T) is saved.
 * Backward (deterministic, no atomics): Di = dout_i . out_i; dq by query rows (the same
 * walk over key tiles, recomputing p from lse); dk and dv by key rows, each warp one key
 * walking the query tiles from that key on. Every gradient row is one sum, added once.
 *
 * These fp32 kernels run in fp32 precision (and wherever the tensor-core path below does
 * not apply); in bf16 / fp16 precision the FlashAttention-2 kernels at the end of the file
 * take the op (16-bit wmma products, fp32 accumulation, same layouts and lse), or, on
 * sm_90 at Hd = 64, the wgmma kernels of sm90/attention_wgmma.cu (fw_family). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"

#include "kernels/cuda/attention_mma.cuh"

/* Which of the op's buffers are marked as holding 16-bit values (backend.h mark_operand):
 * the mma.sync kernels read them (q, k, v as a whole; out and dout) or write them (out,
 * dq, dk, dv) so; no other kernel takes them. */
enum { ATT_QKV16 = 1, ATT_OUT16 = 2, ATT_DOUT16 = 4, ATT_DQ16 = 8, ATT_DK16 = 16, ATT_DV16 = 32 };

/* The tensor-core path (bf16 / fp16 precision; at the end of this file). Each returns 1
 * when it took the op, 0 when the fp32 kernels must run it. m16: the ATT_*16 flags of
 * the buffers (att_marks; -1 a failure). */
static int att_marks(const real *q, const real *k, const real *v, const real *out, const real *dout,
                     const real *dq, const real *dk, const real *dv, size_t n);
static int flash_forward(real *out, real *lse, const real *q, const real *k, const real *v, int B,
                         int T, int H, int Hd, int m16);
/* attention_backward_qkv's request to the wgmma kernels (attention_wgmma.cu, fw_rope):
 * write [dq | dk | dv] (dqkv, 16-bit) with dq and dk rotated back, instead of dq, dk, dv;
 * *fused set where they did. */
typedef struct {
    uint16_t *dqkv;
    const real *cos_t, *sin_t;
    int *fused;
} att_rope_out;

static int flash_backward(real *dq, real *dk, real *dv, const real *dout, const real *lse,
                          const float *dsum, const real *q, const real *k, const real *v, int B,
                          int T, int H, int Hd, uint16_t *c16, int m16, const att_rope_out *ro);
static size_t flash_backward_copies(int B, int T, int H, int Hd, int m16);

#define ATT_WARPS 8 /* queries (forward, dq) or keys (dk, dv) per block */
#define ATT_TILE 32 /* keys (or queries) per shared tile: one per lane */
#define ATT_MAX_HD 128
#define ATT_DPL (ATT_MAX_HD / 32) /* head dims per lane */
#define ATT_THREADS (ATT_WARPS * 32)

/* q . k over Hd, both in shared memory */
static __device__ __forceinline__ float dot_sh(const float *a, const float *b, int Hd)
{
    float s = 0.f;
    for (int d = 0; d < Hd; d++)
        s = fmaf(a[d], b[d], s);
    return s;
}

/* rows [j0, j0 + ATT_TILE) of a (sequence, head) slice into shared (row stride lds), 0
 * past T */
static __device__ __forceinline__ void load_tile(float *dst, int lds, const real *src, size_t ld,
                                                 int j0, int T, int Hd)
{
    for (int e = threadIdx.x; e < ATT_TILE * Hd; e += blockDim.x) {
        const int r = e / Hd, d = e % Hd, j = j0 + r;
        dst[r * lds + d] = j < T ? src[(size_t)j * ld + d] : 0.f;
    }
}

static __global__ void attention_forward_kernel(real *out, real *lse, const real *q, const real *k,
                                                const real *v, int T, int H, int Hd, float scale)
{
    extern __shared__ float sm[];
    const int ldk = Hd + 1; /* odd stride: lane l reading row l is conflict-free */
    float *ks = sm, *vs = ks + ATT_TILE * ldk, *qs = vs + ATT_TILE * Hd;
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ATT_WARPS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = q0 + warp;
    const int active = i < T;
    const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
    float *qw = qs + warp * Hd;
    if (active)
        for (int d = lane; d < Hd; d += 32)
            qw[d] = q[base + (size_t)i * ld + d];
    float m = -INFINITY, l = 0.f, acc[ATT_DPL];
    for (int c = 0; c < ATT_DPL; c++)
        acc[c] = 0.f;
    const int kend = min(T, q0 + ATT_WARPS);
    for (int j0 = 0; j0 < kend; j0 += ATT_TILE) {
        __syncthreads();
        load_tile(ks, ldk, k + base, ld, j0, T, Hd);
        load_tile(vs, Hd, v + base, ld, j0, T, Hd);
        __syncthreads();
        if (!active || j0 > i)
            continue; /* warp-uniform */
        const int j = j0 + lane;
        const float s = j <= i ? dot_sh(qw, ks + lane * ldk, Hd) * scale : -INFINITY;
        const float mnew = fmaxf(m, moe_warp_max(s)); /* finite: key j0 <= i is in */
        const float corr = expf(m - mnew);
        const float p = j <= i ? expf(s - mnew) : 0.f;
        l = l * corr + moe_warp_sum(p);
        for (int c = 0; c < ATT_DPL; c++)
            acc[c] *= corr;
        const int jn = min(ATT_TILE, i - j0 + 1);
        for (int jj = 0; jj < jn; jj++) {
            const float pj = __shfl_sync(MOE_CUDA_FULL_MASK, p, jj);
            for (int c = 0; c < ATT_DPL; c++) {
                const int d = lane + 32 * c;
                if (d < Hd)
                    acc[c] = fmaf(pj, vs[jj * Hd + d], acc[c]);
            }
        }
        m = mnew;
    }
    if (!active)
        return;
    const float inv = 1.f / l;
    for (int c = 0; c < ATT_DPL; c++) {
        const int d = lane + 32 * c;
        if (d < Hd)
            out[base + (size_t)i * ld + d] = acc[c] * inv;
    }
    if (lane == 0)
        lse[((size_t)b * H + h) * T + i] = m + logf(l);
}

/* Checks the head dim; returns 0 (recorded) when the kernels cannot run it. */
static int head_dim_ok(int Hd)
{
    if (Hd <= ATT_MAX_HD)
        return 1;
    MOE_CUDA_FAIL("attention: head dim %d is larger than the %d the kernels support", Hd,
                  ATT_MAX_HD);
    return 0;
}

extern "C" void cuda_attention_forward(real *out, real *lse, const real *q, const real *k,
                                       const real *v, int B, int T, int H, int Hd)
{
    if (B <= 0 || T <= 0 || H <= 0 || Hd <= 0 || !head_dim_ok(Hd))
        return;
    const int m16 = att_marks(q, k, v, out, NULL, NULL, NULL, NULL, (size_t)B * T * H * Hd);
    if (m16 < 0 || flash_forward(out, lse, q, k, v, B, T, H, Hd, m16))
        return;
    const size_t smem = sizeof(float) * ((size_t)ATT_TILE * (Hd + 1) + (size_t)ATT_TILE * Hd +
                                         (size_t)ATT_WARPS * Hd);
    const dim3 grid((T + ATT_WARPS - 1) / ATT_WARPS, H, B);
    MOE_CUDA_LAUNCH(attention_forward_kernel, grid, ATT_THREADS, smem, out, lse, q, k, v, T, H, Hd,
                    (float)(1.0 / sqrt((double)Hd)));
}

/* ---- backward ------------------------------------------------------------------------ */

/* dsum (B, H, T) = dout_i . out_i in double, 8 lanes per (sequence, query, head), the
 * heads of a query on neighbouring lanes (their rows lie side by side); G16, O16: dout,
 * out hold 16-bit values (bf16 by `bf16`). */
#define DSUM_LANES 8

/* A thread's place in dsum: its group of DSUM_LANES lanes (sequence b, query i, head h;
 * live: the group lies inside the B * H * T rows, all its lanes alike), its lane sub, and
 * the row's first element off in dout and out. */
typedef struct {
    size_t b, i, h, off;
    int sub;
    bool live;
} dsum_place;

static __device__ __forceinline__ dsum_place dsum_where(int B, int T, int H, int Hd)
{
    dsum_place p;
    const size_t g = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / DSUM_LANES;
    p.sub = threadIdx.x % DSUM_LANES;
    p.live = g < (size_t)B * H * T; /* the whole group drops out together */
    p.h = g % H, p.i = (g / H) % T, p.b = g / ((size_t)H * T);
    p.off = (p.b * T + p.i) * (size_t)H * Hd + p.h * Hd;
    return p;
}

/* The group's lanes' sums s added (a fixed order) and stored by its first lane. */
static __device__ __forceinline__ void dsum_store(float *dsum, double s, const dsum_place &p, int T,
                                                  int H)
{
#pragma unroll
    for (int o = DSUM_LANES / 2; o > 0; o >>= 1)
        s += __shfl_xor_sync(MOE_CUDA_FULL_MASK, s, o);
    if (p.live && p.sub == 0)
        dsum[(p.b * H + p.h) * T + p.i] = (float)s;
}

template <int G16, int O16>
static __global__ void attention_dsum_kernel(float *dsum, const real *dout, const real *out, int B,
                                             int T, int H, int Hd, int bf16)
{
    const dsum_place p = dsum_where(B, T, H, Hd);
    double s = 0.0;
    for (int d = p.sub; p.live && d < Hd; d += DSUM_LANES)
        s += (double)moe_ld<G16>(dout, p.off + d, bf16) * moe_ld<O16>(out, p.off + d, bf16);
    dsum_store(dsum, s, p, T, H);
}

/* The same from 16-bit dout and out (Hd a multiple of 8, both 16-byte aligned): a lane
 * takes 8 neighbouring values of each a load (16 bytes) and adds their products in
 * order, in double; then the 8 lanes as above. */
static __global__ void attention_dsum8_kernel(float *dsum, const uint4 *dout, const uint4 *out,
                                              int B, int T, int H, int Hd, int bf16)
{
    const dsum_place p = dsum_where(B, T, H, Hd);
    const size_t off8 = p.off / 8;
    double s = 0.0;
    for (int d8 = p.sub; p.live && d8 < Hd / 8; d8 += DSUM_LANES) {
        const uint4 x = dout[off8 + d8], y = out[off8 + d8];
        const float4 x0 = moe_widen16x4(make_uint2(x.x, x.y), bf16),
                     x1 = moe_widen16x4(make_uint2(x.z, x.w), bf16),
                     y0 = moe_widen16x4(make_uint2(y.x, y.y), bf16),
                     y1 = moe_widen16x4(make_uint2(y.z, y.w), bf16);
        s += (double)x0.x * y0.x;
        s += (double)x0.y * y0.y;
        s += (double)x0.z * y0.z;
        s += (double)x0.w * y0.w;
        s += (double)x1.x * y1.x;
        s += (double)x1.y * y1.y;
        s += (double)x1.z * y1.z;
        s += (double)x1.w * y1.w;
    }
    dsum_store(dsum, s, p, T, H);
}

static long n_dsum8; /* launches of attention_dsum8_kernel (tests) */

extern "C" long moe_cuda_attention_dsum8(void) { return n_dsum8; }

/* dq_i = scale * sum_{j <= i} p_ij (dout_i . v_j - D_i) k_j, one warp per query. */
static __global__ void attention_dq_kernel(real *dq, const real *dout, const real *lse,
                                           const float *dsum, const real *q, const real *k,
                                           const real *v, int T, int H, int Hd, float scale)
{
    extern __shared__ float sm[];
    const int ldk = Hd + 1;
    float *ks = sm, *vs = ks + ATT_TILE * ldk, *qs = vs + ATT_TILE * ldk, *gs = qs + ATT_WARPS * Hd;
    const int b = blockIdx.z, h = blockIdx.y, q0 = blockIdx.x * ATT_WARPS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, i = q0 + warp;
    const int active = i < T;
    const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
    const size_t row = ((size_t)b * H + h) * T + i;
    float *qw = qs + warp * Hd, *gw = gs + warp * Hd;
    if (active)
        for (int d = lane; d < Hd; d += 32) {
            qw[d] = q[base + (size_t)i * ld + d];
            gw[d] = dout[base + (size_t)i * ld + d];
        }
    const float lse_i = active ? lse[row] : 0.f, D_i = active ? dsum[row] : 0.f;
    float acc[ATT_DPL];
    for (int c = 0; c < ATT_DPL; c++)
        acc[c] = 0.f;
    const int kend = min(T, q0 + ATT_WARPS);
    for (int j0 = 0; j0 < kend; j0 += ATT_TILE) {
        __syncthreads();
        load_tile(ks, ldk, k + base, ld, j0, T, Hd);
        load_tile(vs, ldk, v + base, ld, j0, T, Hd);
        __syncthreads();
        if (!active || j0 > i)
            continue;
        const int j = j0 + lane;
        float ds = 0.f;
        if (j <= i) {
            const float p = expf(dot_sh(qw, ks + lane * ldk, Hd) * scale - lse_i);
            ds = p * (dot_sh(gw, vs + lane * ldk, Hd) - D_i);
        }
        const int jn = min(ATT_TILE, i - j0 + 1);
        for (int jj = 0; jj < jn; jj++) {
            const float dsj = __shfl_sync(MOE_CUDA_FULL_MASK, ds, jj);
            for (int c = 0; c < ATT_DPL; c++) {
                const int d = lane + 32 * c;
                if (d < Hd)
                    acc[c] = fmaf(dsj, ks[jj * ldk + d], acc[c]);
            }
        }
    }
    if (!active)
        return;
    for (int c = 0; c < ATT_DPL; c++) {
        const int d = lane + 32 * c;
        if (d < Hd)
            dq[base + (size_t)i * ld + d] = scale * acc[c];
    }
}

/* dk_j = scale * sum_{i >= j} ds_ij q_i ; dv_j = sum_{i >= j} p_ij dout_i, one warp per
 * key walking the query tiles. */
static __global__ void attention_dkv_kernel(real *dk, real *dv, const real *dout, const real *lse,
                                            const float *dsum, const real *q, const real *k,
                                            const real *v, int T, int H, int Hd, float scale)
{
    extern __shared__ float sm[];
    const int ldk = Hd + 1;
    float *qs = sm, *gs = qs + ATT_TILE * ldk, *ls = gs + ATT_TILE * ldk, *Ds = ls + ATT_TILE;
    float *kws = Ds + ATT_TILE, *vws = kws + ATT_WARPS * Hd;
    const int b = blockIdx.z, h = blockIdx.y, j_first = blockIdx.x * ATT_WARPS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = j_first + warp;
    const int active = j < T;
    const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
    const size_t bh = (size_t)b * H + h;
    float *kw = kws + warp * Hd, *vw = vws + warp * Hd;
    if (active)
        for (int d = lane; d < Hd; d += 32) {
            kw[d] = k[base + (size_t)j * ld + d];
            vw[d] = v[base + (size_t)j * ld + d];
        }
    float acck[ATT_DPL], accv[ATT_DPL];
    for (int c = 0; c < ATT_DPL; c++)
        acck[c] = accv[c] = 0.f;
    for (int i0 = j_first; i0 < T; i0 += ATT_TILE) {
        __syncthreads();
        load_tile(qs, ldk, q + base, ld, i0, T, Hd);
        load_tile(gs, ldk, dout + base, ld, i0, T, Hd);
        if (threadIdx.x < ATT_TILE) {
            const int i = i0 + threadIdx.x;
            ls[threadIdx.x] = i < T ? lse[bh * T + i] : 0.f;
            Ds[threadIdx.x] = i < T ? dsum[bh * T + i] : 0.f;
        }
        __syncthreads();
        if (!active || i0 + ATT_TILE <= j)
            continue; /* warp-uniform: the whole tile is before key j */
        const int i = i0 + lane;
        float p = 0.f, ds = 0.f;
        if (i < T && i >= j) {
            p = expf(dot_sh(qs + lane * ldk, kw, Hd) * scale - ls[lane]);
            if (dk)
                ds = p * (dot_sh(gs + lane * ldk, vw, Hd) - Ds[lane]);
        }
        const int lo = max(0, j - i0), hi = min(ATT_TILE, T - i0);
        for (int ii = lo; ii < hi; ii++) {
            const float pi = __shfl_sync(MOE_CUDA_FULL_MASK, p, ii);
            const float dsi = __shfl_sync(MOE_CUDA_FULL_MASK, ds, ii);
            for (int c = 0; c < ATT_DPL; c++) {
                const int d = lane + 32 * c;
                if (d < Hd) {
                    accv[c] = fmaf(pi, gs[ii * ldk + d], accv[c]);
                    acck[c] = fmaf(dsi, qs[ii * ldk + d], acck[c]);
                }
            }
        }
    }
    if (!active)
        return;
    for (int c = 0; c < ATT_DPL; c++) {
        const int d = lane + 32 * c;
        if (d >= Hd)
            continue;
        if (dk)
            dk[base + (size_t)j * ld + d] = scale * acck[c];
        if (dv)
            dv[base + (size_t)j * ld + d] = accv[c];
    }
}

static void attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *out,
                               const real *lse, const real *q, const real *k, const real *v, int B,
                               int T, int H, int Hd, const att_rope_out *ro)
{
    if (B <= 0 || T <= 0 || H <= 0 || Hd <= 0 || (!dq && !dk && !dv) || !head_dim_ok(Hd))
        return;
    const size_t rows = (size_t)B * H * T, dsum_bytes = (sizeof(float) * rows + 255) / 256 * 256;
    const size_t n = (size_t)B * T * H * Hd;
    const int m16 = att_marks(q, k, v, out, dout, dq, dk, dv, n);
    if (m16 < 0)
        return;
    /* the wgmma kernels write [dq | dk | dv] for Hd = 64 from marked q, k, v, dq, dk, dv into
     * a marked, aligned dqkv; else the request is dropped (the caller runs rope's op) */
    const int all16 = ATT_QKV16 | ATT_DQ16 | ATT_DK16 | ATT_DV16;
    int dqkv_bf16 = 0;
    if (ro && !((m16 & all16) == all16 && Hd == 64 && moe_aligned16(ro->dqkv) &&
                cuda_operand_in_place(ro->dqkv, 3 * n, &dqkv_bf16)))
        ro = NULL;
    const size_t copies = flash_backward_copies(B, T, H, Hd, m16); /* after dsum */
    char *scratch = (char *)moe_cuda_scratch(dsum_bytes + sizeof(uint16_t) * copies);
    if (!scratch)
        return;
    float *dsum = (float *)scratch;
    uint16_t *c16 = copies ? (uint16_t *)(scratch + dsum_bytes) : NULL;
    const float scale = (float)(1.0 / sqrt((double)Hd));
    const unsigned dsum_blocks = /* one group per row, no grid stride */
        (unsigned)((rows * DSUM_LANES + ATT_THREADS - 1) / ATT_THREADS);
    const int bf16 = cuda_gemm_precision() == MOE_PREC_BF16;
    if ((m16 & ATT_DOUT16) && (m16 & ATT_OUT16) && Hd % 8 == 0 && moe_aligned16(dout) &&
        moe_aligned16(out)) {
        n_dsum8++;
        MOE_CUDA_LAUNCH(attention_dsum8_kernel, dsum_blocks, ATT_THREADS, 0, dsum,
                        (const uint4 *)dout, (const uint4 *)out, B, T, H, Hd, bf16);
    } else {
        moe_cuda_pick(
            [&](auto g16_, auto o16_) {
                constexpr int G16 = decltype(g16_)::value, O16 = decltype(o16_)::value;
                MOE_CUDA_LAUNCH((attention_dsum_kernel<G16, O16>), dsum_blocks, ATT_THREADS, 0,
                                dsum, dout, out, B, T, H, Hd, bf16);
            },
            (m16 & ATT_DOUT16) != 0, (m16 & ATT_OUT16) != 0);
    }
    if (flash_backward(dq, dk, dv, dout, lse, dsum, q, k, v, B, T, H, Hd, c16, m16, ro))
        return;
    const dim3 grid((T + ATT_WARPS - 1) / ATT_WARPS, H, B);
    const size_t tile = (size_t)ATT_TILE * (Hd + 1), rowsmem = (size_t)ATT_WARPS * Hd;
    if (dq)
        MOE_CUDA_LAUNCH(attention_dq_kernel, grid, ATT_THREADS,
                        sizeof(float) * (2 * tile + 2 * rowsmem), dq, dout, lse, dsum, q, k, v, T,
                        H, Hd, scale);
    if (dk || dv)
        MOE_CUDA_LAUNCH(attention_dkv_kernel, grid, ATT_THREADS,
                        sizeof(float) * (2 * tile + 2 * ATT_TILE + 2 * rowsmem), dk, dv, dout, lse,
                        dsum, q, k, v, T, H, Hd, scale);
}

extern "C" void cuda_attention_backward(real *dq, real *dk, real *dv, const real *dout,
                                        const real *out, const real *lse, const real *q,
                                        const real *k, const real *v, int B, int T, int H, int Hd)
{
    attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, T, H, Hd, NULL);
}

static long n_qkv_fused;

/* Where the wgmma kernels run (head dim 64) on marked q, k, v, dq, dk, dv and a marked
 * dqkv, they write dqkv themselves (fw_rope: the same bits; attention_backward decides);
 * else the two ops. MOE_ATTENTION_ROPE=0: the two ops always (a benchmark knob). */
extern "C" void cuda_attention_backward_qkv(real *dqkv, real *dq, real *dk, real *dv,
                                            const real *dout, const real *out, const real *lse,
                                            const real *q, const real *k, const real *v,
                                            const real *cos_t, const real *sin_t, int B, int T,
                                            int H, int Hd)
{
    static int off = -1;
    if (off < 0)
        off = moe_cuda_env_is("MOE_ATTENTION_ROPE", "0");
    int fused = 0;
    const att_rope_out ro = {(uint16_t *)dqkv, cos_t, sin_t, &fused};
    attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, T, H, Hd,
                       off || !dq || !dk || !dv ? NULL : &ro);
    if (!fused)
        cuda_rope_backward_qkv(dqkv, dq, dk, dv, cos_t, sin_t, B, T, H, Hd);
    n_qkv_fused += fused;
}

/* Calls of attention_backward_qkv whose kernels wrote dqkv themselves (for tests). */
extern "C" long moe_cuda_attention_qkv_fused(void) { return n_qkv_fused; }

/* ---- tensor-core path: bf16 / fp16 (FlashAttention-2 style) --------------------------- */
/* Taken when the backend's precision (cuda_gemm_precision, matmul.cu) is bf16 or fp16, Hd
 * is a multiple of 16 up to 128, the q/k/v/out/gradient pointers are 16-byte aligned and
 * the device gives the block its shared memory; otherwise the fp32 kernels above run.
 * Global tensors stay fp32; tiles are rounded to the 16-bit type when staged in shared
 * memory (zero past T and past Hd, Hd padded to FA_HD = 64 or 128), products run on
 * nvcuda::wmma 16x16x16 fragments with fp32 accumulation, softmax and statistics in fp32.
 *
 * A block has 4 warps; a warp owns 16 rows (queries, or keys in dk/dv) of a 64-row block.
 * A warp's 16 x 64 fp32 scratch (row stride FA_LDW) takes the scores; lane l then owns row
 * l / 2 and the columns 8c + 4 (l % 2) + e (c < 8, e < 4) of it, so the row statistics
 * are shared by a lane pair (one shuffle). Probabilities are rounded to 16 bits in place
 * (row stride FA_LDP) as the A operand of the next product.
 *
 * Forward: block = 64 queries of one (sequence, head); key tiles of 64 from 0 to the
 * block's last query (a warp skips the tiles above its rows); online softmax in base 2;
 * each tile's P V is stored to the scratch by 64 columns and folded into the lane's
 * output registers (o = o * corr + pv), so the rescaling is per row in registers.
 * Backward, after Di = dout_i . out_i (the fp32 kernel): dk, dv: block = 64 keys walking
 * the query tiles from its first key on, P^T and dS^T recomputed from lse, dV += P^T dO
 * and dK += dS^T Q in fragments; dq: block = 64 queries walking the key tiles up to its
 * last query, dQ += dS K. Each gradient row is one sum stored once: no atomics,
 * deterministic. Shared memory (bytes): forward 46080 (Hd <= 64) / 70656; dq and dk/dv
 * 55296 / 88064 (+512): above 48 KiB by cudaFuncSetAttribute; on sm_75 (64 KiB at most)
 * Hd > 64 runs the fp32 kernels. bf16 needs sm_80 (the runtime refuses it below). */

namespace wmma = nvcuda::wmma;

#define FA_ROWS 64 /* rows of a block (queries or keys) and of a tile */
#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
#define FA_PAD 8  /* 16-bit elements after each staged row (wmma ldm: a multiple of 8) */
#define FA_LDW 72 /* fp32 row stride of a warp's 16 x 64 scratch (a multiple of 4) */
#define FA_LDP 72 /* 16-bit row stride of P / dS in the scratch */

template <class T16> using fa_a = wmma::fragment<wmma::matrix_a, 16, 16, 16, T16, wmma::row_major>;
/* B = X^T for a row-major X: column-major B */
template <class T16> using fa_bt = wmma::fragment<wmma::matrix_b, 16, 16, 16, T16, wmma::col_major>;
template <class T16> using fa_b = wmma::fragment<wmma::matrix_b, 16, 16, 16, T16, wmma::row_major>;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> fa_acc;

/* Rows [r0, r0 + 64) of a (sequence, head) slice (row stride ld, Hd columns) into shared
 * memory as T16, row stride HD + FA_PAD, columns [0, HD); zero past T and past Hd. */
template <class T16, int HD>
static __device__ __forceinline__ void fa_stage(T16 *dst, const real *src, size_t ld, int r0, int T,
                                                int Hd)
{
    typedef typename fa_type<T16>::pair pair;
    constexpr int C4 = HD / 4, LD = HD + FA_PAD;
    for (int e = threadIdx.x; e < FA_ROWS * C4; e += FA_THREADS) {
        const int r = e / C4, c = (e % C4) * 4, row = r0 + r;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (row < T && c < Hd)
            x = *(const float4 *)(src + (size_t)row * ld + c);
        pair *d = (pair *)(dst + r * LD + c);
        d[0] = fa_type<T16>::pack(x.x, x.y);
        d[1] = fa_type<T16>::pack(x.z, x.w);
    }
}

/* W (16 x 64 fp32, row stride FA_LDW) = A X^T: A the warp's 16 rows, X 64 rows, both
 * HD wide, 16-bit, row stride HD + FA_PAD. */
template <class T16, int HD>
static __device__ __forceinline__ void fa_scores(float *W, const T16 *A, const T16 *X)
{
    constexpr int LD = HD + FA_PAD;
    fa_acc acc[4];
#pragma unroll
    for (int n = 0; n < 4; n++)
        wmma::fill_fragment(acc[n], 0.f);
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
        fa_a<T16> a;
        wmma::load_matrix_sync(a, A + kk * 16, LD);
#pragma unroll
        for (int n = 0; n < 4; n++) {
            fa_bt<T16> bt;
            wmma::load_matrix_sync(bt, X + n * 16 * LD + kk * 16, LD);
            wmma::mma_sync(acc[n], a, bt, acc[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < 4; n++)
        wmma::store_matrix_sync(W + n * 16, acc[n], FA_LDW, wmma::mem_row_major);
}

/* acc[d] += P Y[:, 16d, 16d + 16) for d < HD / 16: P 16 x 64 (16-bit, row stride FA_LDP),
 * Y 64 x HD (16-bit, row stride HD + FA_PAD). Every read of P is done on return. */
template <class T16, int HD>
static __device__ __forceinline__ void fa_pv(fa_acc *acc, const T16 *P, const T16 *Y)
{
    constexpr int LD = HD + FA_PAD;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        fa_a<T16> a;
        wmma::load_matrix_sync(a, P + kk * 16, FA_LDP);
#pragma unroll
        for (int d = 0; d < HD / 16; d++) {
            fa_b<T16> b;
            wmma::load_matrix_sync(b, Y + kk * 16 * LD + d * 16, LD);
            wmma::mma_sync(acc[d], a, b, acc[d]);
        }
    }
}

/* The lane's 32 values of the scratch (row lane / 2, columns 8c + 4 (lane % 2) + e). */
static __device__ __forceinline__ void fa_read(float (&x)[8][4], const float *W, int lane)
{
    const float *row = W + (lane >> 1) * FA_LDW + 4 * (lane & 1);
#pragma unroll
    for (int c = 0; c < 8; c++) {
        const float4 v = *(const float4 *)(row + 8 * c);
        x[c][0] = v.x;
        x[c][1] = v.y;
        x[c][2] = v.z;
        x[c][3] = v.w;
    }
}

/* The lane's 32 values into P (16-bit, row stride FA_LDP), same places. */
template <class T16>
static __device__ __forceinline__ void fa_write(T16 *P, const float (&x)[8][4], int lane)
{
    typedef typename fa_type<T16>::pair pair;
    T16 *row = P + (lane >> 1) * FA_LDP + 4 * (lane & 1);
#pragma unroll
    for (int c = 0; c < 8; c++) {
        pair *d = (pair *)(row + 8 * c);
        d[0] = fa_type<T16>::pack(x[c][0], x[c][1]);
        d[1] = fa_type<T16>::pack(x[c][2], x[c][3]);
    }
}

/* g[row] = mul * acc over the HD columns (those < Hd), through the warp's scratch by
 * 64 columns; rows whose index row0 + r is >= T are skipped. g NULL: nothing. */
template <int HD>
static __device__ __forceinline__ void fa_store_rows(real *g, size_t ld, int row0, int T, int Hd,
                                                     float mul, const fa_acc *acc, float *W,
                                                     int lane)
{
    const int row = row0 + (lane >> 1);
#pragma unroll
    for (int grp = 0; grp < HD / 64; grp++) {
        __syncwarp(); /* earlier reads of the scratch are done */
#pragma unroll
        for (int n = 0; n < 4; n++)
            wmma::store_matrix_sync(W + n * 16, acc[4 * grp + n], FA_LDW, wmma::mem_row_major);
        __syncwarp();
        if (!g || row >= T)
            continue;
        float x[8][4];
        fa_read(x, W, lane);
        real *dst = g + (size_t)row * ld + 64 * grp + 4 * (lane & 1);
#pragma unroll
        for (int c = 0; c < 8; c++) {
            if (64 * grp + 8 * c + 4 * (lane & 1) >= Hd)
                continue;
            *(float4 *)(dst + 8 * c) =
                make_float4(mul * x[c][0], mul * x[c][1], mul * x[c][2], mul * x[c][3]);
        }
    }
}

/* Shared memory of the kernels, in bytes. */
static size_t fa_forward_smem(int HD)
{
    return sizeof(uint16_t) * 3 * FA_ROWS * (HD + FA_PAD) + sizeof(float) * FA_WARPS * 16 * FA_LDW;
}
static size_t fa_backward_smem(int HD)
{
    return sizeof(uint16_t) * 4 * FA_ROWS * (HD + FA_PAD) +
           sizeof(float) * (FA_WARPS * 16 * FA_LDW + 2 * FA_ROWS);
}

/* bf16 fragments exist from sm_80 on: below, the bf16 kernels are empty (never launched:
 * the dispatch refuses them). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define FA_SKIP(T16) std::is_same<T16, __nv_bfloat16>::value
#else
#define FA_SKIP(T16) false
#endif

/* out, lse as the fp32 forward; sl2 = log2(e) / sqrt(Hd). grid (B*H, query tiles): the
 * longest tiles (last queries) are launched first. */
template <class T16, int HD>
static __global__ void __launch_bounds__(FA_THREADS, HD == 64 ? 4 : 3)
    flash_forward_kernel(real *out, real *lse, const real *q, const real *k, const real *v, int T,
                         int H, int Hd, float sl2)
{
    if constexpr (FA_SKIP(T16)) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD, G = HD / 64;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
        T16 *Qs = (T16 *)fa_sm, *Ks = Qs + FA_ROWS * LD, *Vs = Ks + FA_ROWS * LD;
        float *W = (float *)(Vs + FA_ROWS * LD) + warp * 16 * FA_LDW;
        T16 *P = (T16 *)W; /* the probabilities, in place of the scores */
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_ROWS;
        const int first = q0 + 16 * warp, i = first + (lane >> 1); /* the lane's query */
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
        fa_stage<T16, HD>(Qs, q + base, ld, q0, T, Hd);
        float m = -INFINITY, l = 0.f, o[G][8][4];
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[g][c][e] = 0.f;
        const int kend = min(T, q0 + FA_ROWS);
        for (int j0 = 0; j0 < kend; j0 += FA_ROWS) {
            __syncthreads(); /* the previous tile is used up (and Qs staged) */
            fa_stage<T16, HD>(Ks, k + base, ld, j0, T, Hd);
            fa_stage<T16, HD>(Vs, v + base, ld, j0, T, Hd);
            __syncthreads();
            if (j0 > first + 15)
                continue; /* warp-uniform: every key of the tile is after the warp's rows */
            fa_scores<T16, HD>(W, Qs + 16 * warp * LD, Ks);
            __syncwarp();
            float s[8][4];
            fa_read(s, W, lane);
            /* key j0 <= q0 <= i is always in, so mx and mnew are finite */
            float mx = -INFINITY;
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = j0 + 8 * c + 4 * half + e;
                    s[c][e] = j <= i && j < T ? s[c][e] * sl2 : -INFINITY;
                    mx = fmaxf(mx, s[c][e]);
                }
            mx = fmaxf(mx, __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx, 1));
            const float mnew = fmaxf(m, mx), corr = exp2f(m - mnew); /* 0 on the first tile */
            float sum = 0.f;
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[c][e] = exp2f(s[c][e] - mnew); /* masked: exp2(-inf) = 0 */
                    sum += s[c][e];
                }
            sum += __shfl_xor_sync(MOE_CUDA_FULL_MASK, sum, 1);
            l = l * corr + sum;
            m = mnew;
            __syncwarp(); /* every lane has read its scores before P overwrites them */
            fa_write<T16>(P, s, lane);
            __syncwarp();
            fa_a<T16> pa[4]; /* P, kept in registers: the products overwrite it */
#pragma unroll
            for (int kk = 0; kk < 4; kk++)
                wmma::load_matrix_sync(pa[kk], P + kk * 16, FA_LDP);
#pragma unroll
            for (int g = 0; g < G; g++) { /* P V by 64 columns */
                fa_acc pv[4];
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    wmma::fill_fragment(pv[n], 0.f);
#pragma unroll
                    for (int kk = 0; kk < 4; kk++) {
                        fa_b<T16> vb;
                        wmma::load_matrix_sync(vb, Vs + kk * 16 * LD + 64 * g + 16 * n, LD);
                        wmma::mma_sync(pv[n], pa[kk], vb, pv[n]);
                    }
                }
                __syncwarp(); /* P, or the previous 64 columns, are read */
#pragma unroll
                for (int n = 0; n < 4; n++)
                    wmma::store_matrix_sync(W + n * 16, pv[n], FA_LDW, wmma::mem_row_major);
                __syncwarp();
                float x[8][4];
                fa_read(x, W, lane);
#pragma unroll
                for (int c = 0; c < 8; c++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        o[g][c][e] = o[g][c][e] * corr + x[c][e];
            }
        }
        if (i >= T)
            return;
        const float inv = 1.f / l;
        real *orow = out + base + (size_t)i * ld + 4 * half;
#pragma unroll
        for (int g = 0; g < G; g++)
#pragma unroll
            for (int c = 0; c < 8; c++)
                if (64 * g + 8 * c + 4 * half < Hd)
                    *(float4 *)(orow + 64 * g + 8 * c) = make_float4(
                        o[g][c][0] * inv, o[g][c][1] * inv, o[g][c][2] * inv, o[g][c][3] * inv);
        if (!half)
            lse[(size_t)bh * T + i] = (m + log2f(l)) * FA_LN2;
    }
}

/* dq += scale * sum_{j <= i} ds_ij k_j; block = 64 queries walking the key tiles up to its
 * last query. grid (B*H, query tiles), the longest first. */
template <class T16, int HD>
static __global__ void __launch_bounds__(FA_THREADS, HD == 64 ? 3 : 2)
    flash_dq_kernel(real *dq, const real *dout, const real *lse, const float *dsum, const real *q,
                    const real *k, const real *v, int T, int H, int Hd, float scale, float sl2)
{
    if constexpr (FA_SKIP(T16)) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
        T16 *Qs = (T16 *)fa_sm, *Gs = Qs + FA_ROWS * LD, *Ks = Gs + FA_ROWS * LD,
            *Vs = Ks + FA_ROWS * LD;
        float *W = (float *)(Vs + FA_ROWS * LD) + warp * 16 * FA_LDW;
        T16 *P = (T16 *)W; /* dS, in place of dP */
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_ROWS;
        const int first = q0 + 16 * warp, i = first + (lane >> 1);
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
        fa_stage<T16, HD>(Qs, q + base, ld, q0, T, Hd);
        fa_stage<T16, HD>(Gs, dout + base, ld, q0, T, Hd);
        const float lse2 = i < T ? lse[(size_t)bh * T + i] * FA_LOG2E : 0.f;
        const float Di = i < T ? dsum[(size_t)bh * T + i] : 0.f;
        fa_acc acc[HD / 16];
#pragma unroll
        for (int d = 0; d < HD / 16; d++)
            wmma::fill_fragment(acc[d], 0.f);
        const int kend = min(T, q0 + FA_ROWS);
        for (int j0 = 0; j0 < kend; j0 += FA_ROWS) {
            __syncthreads();
            fa_stage<T16, HD>(Ks, k + base, ld, j0, T, Hd);
            fa_stage<T16, HD>(Vs, v + base, ld, j0, T, Hd);
            __syncthreads();
            if (j0 > first + 15)
                continue; /* warp-uniform */
            fa_scores<T16, HD>(W, Qs + 16 * warp * LD, Ks);
            __syncwarp();
            float p[8][4], dp[8][4];
            fa_read(p, W, lane);
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int j = j0 + 8 * c + 4 * half + e;
                    p[c][e] = j <= i && i < T ? exp2f(p[c][e] * sl2 - lse2) : 0.f;
                }
            __syncwarp(); /* the scores are read before dP overwrites them */
            fa_scores<T16, HD>(W, Gs + 16 * warp * LD, Vs);
            __syncwarp();
            fa_read(dp, W, lane);
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    p[c][e] = p[c][e] * (dp[c][e] - Di); /* ds */
            __syncwarp();
            fa_write<T16>(P, p, lane);
            __syncwarp();
            fa_pv<T16, HD>(acc, P, Ks);
        }
        fa_store_rows<HD>(dq + base, ld, first, T, Hd, scale, acc, W, lane);
    }
}

/* dk += scale * sum_{i >= j} ds_ij q_i, dv += sum_{i >= j} p_ij dout_i; block = 64 keys
 * walking the query tiles from its first key on. grid (B*H, key tiles), the longest (first
 * keys) first. dk or dv may be NULL. */
template <class T16, int HD>
static __global__ void __launch_bounds__(FA_THREADS)
    flash_dkv_kernel(real *dk, real *dv, const real *dout, const real *lse, const float *dsum,
                     const real *q, const real *k, const real *v, int T, int H, int Hd, float scale,
                     float sl2)
{
    if constexpr (FA_SKIP(T16)) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, half = lane & 1;
        T16 *Ks = (T16 *)fa_sm, *Vs = Ks + FA_ROWS * LD, *Qs = Vs + FA_ROWS * LD,
            *Gs = Qs + FA_ROWS * LD;
        float *W0 = (float *)(Gs + FA_ROWS * LD), *W = W0 + warp * 16 * FA_LDW;
        float *ls = W0 + FA_WARPS * 16 * FA_LDW, *Ds = ls + FA_ROWS; /* (64) lse * log2e, Di */
        T16 *Pt = (T16 *)W, *dSt = Pt + 16 * FA_LDP; /* P^T, dS^T in place of dP^T */
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int j0 = blockIdx.y * FA_ROWS;
        const int first = j0 + 16 * warp, j = first + (lane >> 1); /* the lane's key */
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
        fa_stage<T16, HD>(Ks, k + base, ld, j0, T, Hd);
        fa_stage<T16, HD>(Vs, v + base, ld, j0, T, Hd);
        fa_acc acck[HD / 16], accv[HD / 16];
#pragma unroll
        for (int d = 0; d < HD / 16; d++) {
            wmma::fill_fragment(acck[d], 0.f);
            wmma::fill_fragment(accv[d], 0.f);
        }
        for (int i0 = j0; i0 < T; i0 += FA_ROWS) {
            __syncthreads();
            fa_stage<T16, HD>(Qs, q + base, ld, i0, T, Hd);
            fa_stage<T16, HD>(Gs, dout + base, ld, i0, T, Hd);
            if (threadIdx.x < FA_ROWS) {
                const int i = i0 + threadIdx.x;
                ls[threadIdx.x] = i < T ? lse[(size_t)bh * T + i] * FA_LOG2E : 0.f;
                Ds[threadIdx.x] = i < T ? dsum[(size_t)bh * T + i] : 0.f;
            }
            __syncthreads();
            /* i0 >= j0 and first <= j0 + 48: the tile always has queries i >= a warp key */
            fa_scores<T16, HD>(W, Ks + 16 * warp * LD, Qs); /* S^T: keys x queries */
            __syncwarp();
            float p[8][4], dp[8][4];
            fa_read(p, W, lane);
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int col = 8 * c + 4 * half + e, i = i0 + col;
                    p[c][e] = i >= j && i < T && j < T ? exp2f(p[c][e] * sl2 - ls[col]) : 0.f;
                }
            __syncwarp();
            fa_scores<T16, HD>(W, Vs + 16 * warp * LD, Gs); /* dP^T */
            __syncwarp();
            fa_read(dp, W, lane);
#pragma unroll
            for (int c = 0; c < 8; c++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[c][e] = p[c][e] * (dp[c][e] - Ds[8 * c + 4 * half + e]); /* ds */
            __syncwarp();
            fa_write<T16>(Pt, p, lane);
            fa_write<T16>(dSt, dp, lane);
            __syncwarp();
            fa_pv<T16, HD>(accv, Pt, Gs);  /* dV += P^T dO */
            fa_pv<T16, HD>(acck, dSt, Qs); /* dK += dS^T Q */
        }
        fa_store_rows<HD>(dv ? dv + base : NULL, ld, first, T, Hd, 1.f, accv, W, lane);
        fa_store_rows<HD>(dk ? dk + base : NULL, ld, first, T, Hd, scale, acck, W, lane);
    }
}

/* ---- sm_80 and later: mma.sync m16n8k16, the tiles' products in registers ----------- */
/* The same blocks, walks, staging and outputs as the wmma kernels above, but the products
 * are PTX mma.sync.m16n8k16 (fp32 accumulation) fed by ldmatrix, and a tile's scores,
 * probabilities and dS never leave registers: an m16n8 accumulator holds, in lane l, rows
 * l / 4 and l / 4 + 8 at columns 2 (l % 4) + {0, 1}, which is, rounded in pairs, the A
 * operand of the next product. A lane thus owns 2 of its warp's 16 rows, whose statistics
 * 4 lanes share (two shuffles), and the warp's A operands (Q, dO; K, V in dk/dv) are loaded
 * once per block. No scratch, so no shared-memory round trip per tile. The kernels read
 * 16-bit copies of q, k, v (and dout) made by one rounding pass each in the backend's
 * scratch, so tiles arrive by cp.async, the next tile's copy running while the current one
 * is used (two buffers; fm_prefetch_kv for the forward's and dq's key tiles). sm_75 has
 * no 16x8x16 shape (nor cp.async): it keeps the wmma kernels (MOE_ATTENTION=wmma selects
 * them on any GPU, so their tests run there too). */

/* c (16x8, fp32) += a (16x16) b (16x8). */
template <class T16>
static __device__ __forceinline__ void fm_mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                              unsigned b1)
{
#if !FM_SKIP
    if constexpr (std::is_same<T16, __half>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* A operands of a warp's 16 rows (row stride LD, HD wide), one per 16 columns. */
template <class T16, int HD>
static __device__ __forceinline__ void fm_load_a(unsigned (&a)[HD / 16][4], const T16 *rows,
                                                 int lane)
{
    const T16 *p = rows + (lane & 15) * (HD + FA_PAD) + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
        fm_ldsm(a[kk], p + kk * 16);
}

/* s[t] (16 x 64) = A[t] X^T for MT m-tiles of 16 rows: A[t] a warp's operands, X 64 staged
 * rows (row stride LD); each B fragment, loaded once, serves every m-tile. */
template <class T16, int HD, int MT>
static __device__ __forceinline__ void
fm_scores_mt(float (&s)[MT][8][4], const unsigned (&a)[MT][HD / 16][4], const T16 *X, int lane)
{
    const T16 *p = X + ((lane & 7) + (lane >> 4) * 8) * (HD + FA_PAD) + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int t = 0; t < MT; t++)
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[t][n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++)
#pragma unroll
        for (int np = 0; np < 4; np++) { /* column tiles 2np, 2np + 1 */
            unsigned b[4];
            fm_ldsm(b, p + np * 16 * (HD + FA_PAD) + kk * 16);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                fm_mma<T16>(s[t][2 * np], a[t][kk], b[0], b[1]);
                fm_mma<T16>(s[t][2 * np + 1], a[t][kk], b[2], b[3]);
            }
        }
}

/* s (16 x 64) = A X^T: one m-tile of fm_scores_mt. */
template <class T16, int HD>
static __device__ __forceinline__ void fm_scores(float (&s)[8][4], const unsigned (&a)[HD / 16][4],
                                                 const T16 *X, int lane)
{
    fm_scores_mt<T16, HD, 1>(*(float(*)[1][8][4]) & s, *(const unsigned(*)[1][HD / 16][4]) & a, X,
                             lane);
}

/* acc[t] (16 x HD) += P[t] Y for MT m-tiles: P[t] (16 x 64) in accumulator layout, Y 64
 * staged rows x HD; each B fragment, loaded once, serves every m-tile. */
template <class T16, int HD, int MT>
static __device__ __forceinline__ void fm_pv_mt(float (&acc)[MT][HD / 8][4],
                                                const float (&p)[MT][8][4], const T16 *Y, int lane)
{
    const T16 *y = Y + ((lane & 7) + ((lane >> 3) & 1) * 8) * (HD + FA_PAD) + (lane >> 4) * 8;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) { /* rows 16kk .. 16kk + 15 of Y */
        unsigned a[MT][4];
#pragma unroll
        for (int t = 0; t < MT; t++) {
            a[t][0] = fm_pack<T16>(p[t][2 * kk][0], p[t][2 * kk][1]);
            a[t][1] = fm_pack<T16>(p[t][2 * kk][2], p[t][2 * kk][3]);
            a[t][2] = fm_pack<T16>(p[t][2 * kk + 1][0], p[t][2 * kk + 1][1]);
            a[t][3] = fm_pack<T16>(p[t][2 * kk + 1][2], p[t][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < HD / 16; dp++) {
            unsigned b[4];
            fm_ldsm_t(b, y + kk * 16 * (HD + FA_PAD) + dp * 16);
#pragma unroll
            for (int t = 0; t < MT; t++) {
                fm_mma<T16>(acc[t][2 * dp], a[t], b[0], b[1]);
                fm_mma<T16>(acc[t][2 * dp + 1], a[t], b[2], b[3]);
            }
        }
    }
}

/* acc (16 x HD) += P Y: one m-tile of fm_pv_mt. */
template <class T16, int HD>
static __device__ __forceinline__ void fm_pv(float (&acc)[HD / 8][4], const float (&p)[8][4],
                                             const T16 *Y, int lane)
{
    fm_pv_mt<T16, HD, 1>(*(float(*)[1][HD / 8][4]) & acc, *(const float(*)[1][8][4]) & p, Y, lane);
}

/* Rows [r0, r0 + 64) of a 16-bit (sequence, head) slice (row stride ld, Hd columns) into
 * shared memory (row stride HD + FA_PAD) by cp.async of 16 bytes, zero past T and past Hd;
 * the caller commits the group. */
template <class T16, int HD>
static __device__ __forceinline__ void fm_stage(T16 *dst, const T16 *src, size_t ld, int r0, int T,
                                                int Hd)
{
#if !FM_SKIP
    constexpr int C8 = HD / 8;
    for (int e = threadIdx.x; e < FA_ROWS * C8; e += FA_THREADS) {
        const int r = e / C8, c = (e % C8) * 8, row = r0 + r;
        const int in = row < T && c < Hd;
        const T16 *s = in ? src + (size_t)row * ld + c : src; /* zero-filled: 0 bytes read */
        const unsigned d = (unsigned)__cvta_generic_to_shared(dst + r * (HD + FA_PAD) + c);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(s),
                     "r"(in ? 16 : 0));
    }
#endif
}

/* The key tiles of the forward and dq, double-buffered in KV (K0, V0, K1, V1): rows
 * [j, j + 64) of k and v into buffer buf by cp.async, committed as one group together
 * with this thread's uncommitted copies (in the prologue, the Q and dO tiles). The caller
 * waits (fm_wait_all) and synchronises before the tile is read. */
template <class T16, int HD>
static __device__ __forceinline__ void fm_prefetch_kv(T16 *KV, int buf, const T16 *k, const T16 *v,
                                                      size_t ld, int j, int T, int Hd)
{
    T16 *Ks = KV + 2 * buf * FA_ROWS * (HD + FA_PAD);
    fm_stage<T16, HD>(Ks, k, ld, j, T, Hd);
    fm_stage<T16, HD>(Ks + FA_ROWS * (HD + FA_PAD), v, ld, j, T, Hd);
    fm_commit();
}

/* Shared memory: forward Q + 2 x (K, V); backward 2 fixed tiles + 2 x 2 walked tiles (and
 * 2 x 2 x 64 row statistics in dk/dv). */
static size_t fm_tile_bytes(int HD) { return sizeof(uint16_t) * FA_ROWS * (HD + FA_PAD); }
static int fm_forward_mt(int HD);
static size_t fm_forward_smem(int HD) { return (4 + fm_forward_mt(HD)) * fm_tile_bytes(HD); }
static size_t fm_backward_smem(int HD)
{
    return 6 * fm_tile_bytes(HD) + sizeof(float) * 4 * FA_ROWS;
}

/* Query m-tiles of 16 rows per warp of the forward: 2 where HD = 64 (each K and V fragment
 * loaded from shared memory then serves 32 rows: the loads per product halve; 238
 * registers, 2 blocks an SM), 1 at HD = 128 (2 would spill). A block has 4 warps: 64 * MT
 * queries. MOE_ATTENTION_MT=1 in the environment keeps one m-tile at HD = 64 (a
 * benchmark knob: the two side by side). */
static int fm_forward_mt(int HD)
{
    static int one = -1;
    if (one < 0) {
        const char *e = getenv("MOE_ATTENTION_MT");
        one = e && strcmp(e, "1") == 0;
    }
    return HD == 64 && !one ? 2 : 1;
}

/* As flash_forward_kernel, from 16-bit copies of q, k, v; the next key tile is copied in
 * while the current one is used. A warp takes MT m-tiles of 16 queries (rows first + 16 t
 * + lane / 4, + 8); the key tiles it walks all start at or before its first row (q0 and j0
 * are multiples of 64, first = q0 + 16 MT warp), so every row's first key is in. */
template <class T16, int HD, int MT>
static __global__ void __launch_bounds__(FA_THREADS, HD == 64 && MT == 1 ? 3 : 2)
    fm_forward_kernel(real *out, real *lse, const T16 *q, const T16 *k, const T16 *v, int T, int H,
                      int Hd, float sl2, int o16)
{
    if constexpr (FM_SKIP) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD, BR = FA_ROWS * MT;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
        T16 *Qs = (T16 *)fa_sm, *KV = Qs + BR * LD; /* KV: K0, V0, K1, V1 */
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int q0 = (gridDim.y - 1 - blockIdx.y) * BR, first = q0 + 16 * MT * warp;
        int row[MT][2]; /* the lane's queries */
#pragma unroll
        for (int t = 0; t < MT; t++) {
            row[t][0] = first + 16 * t + (lane >> 2);
            row[t][1] = row[t][0] + 8;
        }
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
#pragma unroll
        for (int t = 0; t < MT; t++)
            fm_stage<T16, HD>(Qs + t * FA_ROWS * LD, q + base, ld, q0 + t * FA_ROWS, T, Hd);
        fm_prefetch_kv<T16, HD>(KV, 0, k + base, v + base, ld, 0, T, Hd);
        fm_wait_all();
        __syncthreads();
        unsigned qa[MT][HD / 16][4];
#pragma unroll
        for (int t = 0; t < MT; t++)
            fm_load_a<T16, HD>(qa[t], Qs + (16 * MT * warp + 16 * t) * LD, lane);
        float o[MT][HD / 8][4], m[MT][2], l[MT][2];
#pragma unroll
        for (int t = 0; t < MT; t++) {
            m[t][0] = m[t][1] = -INFINITY;
            l[t][0] = l[t][1] = 0.f;
#pragma unroll
            for (int n = 0; n < HD / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    o[t][n][e] = 0.f;
        }
        const int kend = min(T, q0 + BR);
        for (int j0 = 0, tb = 0; j0 < kend; j0 += FA_ROWS, tb ^= 1) {
            const T16 *Ks = KV + 2 * tb * FA_ROWS * LD, *Vs = Ks + FA_ROWS * LD;
            if (j0 + FA_ROWS < kend) /* the next tile into the other buffer */
                fm_prefetch_kv<T16, HD>(KV, tb ^ 1, k + base, v + base, ld, j0 + FA_ROWS, T, Hd);
            if (j0 <= first + 16 * MT - 1) { /* warp-uniform: else every key is after its rows */
                float s[MT][8][4];
                fm_scores_mt<T16, HD, MT>(s, qa, Ks, lane);
#pragma unroll
                for (int t = 0; t < MT; t++) {
                    /* key j0 <= first <= row is always in, so mx and mnew are finite */
                    float mx[2] = {-INFINITY, -INFINITY};
                    fm_each(
                        j0 + FA_ROWS <= q0, /* every key before every query */
                        [&](int n, int e) {
                            const int j = j0 + 8 * n + 2 * quad + (e & 1);
                            return j <= row[t][e >> 1] && j < T;
                        },
                        [&](int n, int e, bool keep) {
                            s[t][n][e] = keep ? s[t][n][e] * sl2 : -INFINITY;
                            mx[e >> 1] = fmaxf(mx[e >> 1], s[t][n][e]);
                        });
                    float corr[2], sum[2] = {0.f, 0.f};
#pragma unroll
                    for (int r = 0; r < 2; r++) {
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 1));
                        mx[r] = fmaxf(mx[r], __shfl_xor_sync(MOE_CUDA_FULL_MASK, mx[r], 2));
                        const float mnew = fmaxf(m[t][r], mx[r]);
                        corr[r] = fm_exp2(m[t][r] - mnew); /* 0 on the first tile */
                        m[t][r] = mnew;
                    }
#pragma unroll
                    for (int n = 0; n < 8; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            s[t][n][e] = fm_exp2(s[t][n][e] - m[t][e >> 1]); /* exp2(-inf) = 0 */
                            sum[e >> 1] += s[t][n][e];
                        }
#pragma unroll
                    for (int r = 0; r < 2; r++)
                        l[t][r] = l[t][r] * corr[r] + sum[r]; /* the lane's share */
#pragma unroll
                    for (int n = 0; n < HD / 8; n++)
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            o[t][n][e] *= corr[e >> 1];
                }
                fm_pv_mt<T16, HD, MT>(o, s, Vs, lane);
            }
            fm_wait_all();
            __syncthreads(); /* this tile is used up, the next one is in */
        }
#pragma unroll
        for (int t = 0; t < MT; t++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                l[t][r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[t][r], 1);
                l[t][r] += __shfl_xor_sync(MOE_CUDA_FULL_MASK, l[t][r], 2);
                if (row[t][r] >= T)
                    continue;
                const float inv = 1.f / l[t][r];
                const size_t orow = base + (size_t)row[t][r] * ld + 2 * quad; /* o16: T16 */
#pragma unroll
                for (int n = 0; n < HD / 8; n++)
                    if (8 * n + 2 * quad < Hd) {
                        const float a = o[t][n][2 * r] * inv, c = o[t][n][2 * r + 1] * inv;
                        if (o16)
                            *(unsigned *)((T16 *)out + orow + 8 * n) = fm_pack<T16>(a, c);
                        else
                            *(float2 *)(out + orow + 8 * n) = make_float2(a, c);
                    }
                if (quad == 0)
                    lse[(size_t)bh * T + row[t][r]] = (m[t][r] + log2f(l[t][r])) * FA_LN2;
            }
    }
}

/* As flash_dq_kernel, from 16-bit copies of q, k, v, dout; K and V tiles double-buffered. */
template <class T16, int HD>
static __global__ void __launch_bounds__(FA_THREADS, HD == 64 ? 3 : 2)
    fm_dq_kernel(real *dq, const T16 *dout, const real *lse, const float *dsum, const T16 *q,
                 const T16 *k, const T16 *v, int T, int H, int Hd, float scale, float sl2, int dq16)
{
    if constexpr (FM_SKIP) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
        T16 *Qs = (T16 *)fa_sm, *Gs = Qs + FA_ROWS * LD, *KV = Gs + FA_ROWS * LD;
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int q0 = (gridDim.y - 1 - blockIdx.y) * FA_ROWS, first = q0 + 16 * warp;
        const int row[2] = {first + (lane >> 2), first + (lane >> 2) + 8};
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
        fm_stage<T16, HD>(Qs, q + base, ld, q0, T, Hd);
        fm_stage<T16, HD>(Gs, dout + base, ld, q0, T, Hd);
        fm_prefetch_kv<T16, HD>(KV, 0, k + base, v + base, ld, 0, T, Hd);
        float lse2[2], Di[2];
        fm_row_stats(lse2, Di, lse, dsum, bh, T, row);
        fm_wait_all();
        __syncthreads();
        unsigned qa[HD / 16][4], ga[HD / 16][4];
        fm_load_a<T16, HD>(qa, Qs + 16 * warp * LD, lane);
        fm_load_a<T16, HD>(ga, Gs + 16 * warp * LD, lane);
        float acc[HD / 8][4];
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[n][e] = 0.f;
        const int kend = min(T, q0 + FA_ROWS);
        for (int j0 = 0, t = 0; j0 < kend; j0 += FA_ROWS, t ^= 1) {
            const T16 *Ks = KV + 2 * t * FA_ROWS * LD, *Vs = Ks + FA_ROWS * LD;
            if (j0 + FA_ROWS < kend)
                fm_prefetch_kv<T16, HD>(KV, t ^ 1, k + base, v + base, ld, j0 + FA_ROWS, T, Hd);
            if (j0 <= first + 15) { /* warp-uniform */
                float p[8][4], dp[8][4];
                fm_scores<T16, HD>(p, qa, Ks, lane);
                fm_each(
                    j0 + FA_ROWS <= q0 && q0 + FA_ROWS <= T, /* no key after a query */
                    [&](int n, int e) {
                        return j0 + 8 * n + 2 * quad + (e & 1) <= row[e >> 1] && row[e >> 1] < T;
                    },
                    [&](int n, int e, bool keep) {
                        p[n][e] = keep ? fm_exp2(p[n][e] * sl2 - lse2[e >> 1]) : 0.f;
                    });
                fm_scores<T16, HD>(dp, ga, Vs, lane); /* dP = dO V^T */
#pragma unroll
                for (int n = 0; n < 8; n++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        p[n][e] *= dp[n][e] - Di[e >> 1]; /* dS */
                fm_pv<T16, HD>(acc, p, Ks, lane);         /* dQ += dS K */
            }
            fm_wait_all();
            __syncthreads();
        }
        fm_store_rows<T16, HD>(dq, base, ld, first, T, Hd, scale, acc, lane, dq16);
    }
}

/* As flash_dkv_kernel, from 16-bit copies: a warp's 16 keys against each query tile,
 * S^T = K Q^T; the Q, dO tiles and their row statistics double-buffered. */
template <class T16, int HD>
static __global__ void __launch_bounds__(FA_THREADS, 2)
    fm_dkv_kernel(real *dk, real *dv, const T16 *dout, const real *lse, const float *dsum,
                  const T16 *q, const T16 *k, const T16 *v, int T, int H, int Hd, float scale,
                  float sl2, int dk16, int dv16)
{
    if constexpr (FM_SKIP) {
        __trap();
    } else {
        constexpr int LD = HD + FA_PAD;
        extern __shared__ __align__(128) unsigned char fa_sm[];
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, quad = lane & 3;
        T16 *Ks = (T16 *)fa_sm, *Vs = Ks + FA_ROWS * LD, *QG = Vs + FA_ROWS * LD; /* Q0 G0 Q1 G1 */
        float *st = (float *)(QG + 4 * FA_ROWS * LD); /* per buffer: lse * log2e (64), Di (64) */
        const int bh = blockIdx.x, b = bh / H, h = bh % H;
        const int j0 = blockIdx.y * FA_ROWS, first = j0 + 16 * warp;
        const int key[2] = {first + (lane >> 2), first + (lane >> 2) + 8}; /* the lane's keys */
        const size_t ld = (size_t)H * Hd, base = (size_t)b * T * ld + (size_t)h * Hd;
        fm_stage<T16, HD>(Ks, k + base, ld, j0, T, Hd);
        fm_stage<T16, HD>(Vs, v + base, ld, j0, T, Hd);
        fm_stage<T16, HD>(QG, q + base, ld, j0, T, Hd);
        fm_stage<T16, HD>(QG + FA_ROWS * LD, dout + base, ld, j0, T, Hd);
        fm_commit();
        fm_stage_stats(st, lse, dsum, bh, T, j0);
        fm_wait_all();
        __syncthreads();
        unsigned ka[HD / 16][4], va[HD / 16][4];
        fm_load_a<T16, HD>(ka, Ks + 16 * warp * LD, lane);
        fm_load_a<T16, HD>(va, Vs + 16 * warp * LD, lane);
        float dka[HD / 8][4], dva[HD / 8][4];
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dka[n][e] = dva[n][e] = 0.f;
        for (int i0 = j0, t = 0; i0 < T; i0 += FA_ROWS, t ^= 1) {
            const T16 *Qs = QG + 2 * t * FA_ROWS * LD, *Gs = Qs + FA_ROWS * LD;
            const float *ls = st + 2 * t * FA_ROWS, *Ds = ls + FA_ROWS;
            if (i0 + FA_ROWS < T) { /* the next query tile into the other buffer */
                const int n0 = i0 + FA_ROWS;
                T16 *nq = QG + 2 * (t ^ 1) * FA_ROWS * LD;
                fm_stage<T16, HD>(nq, q + base, ld, n0, T, Hd);
                fm_stage<T16, HD>(nq + FA_ROWS * LD, dout + base, ld, n0, T, Hd);
                fm_commit();
                fm_stage_stats(st + 2 * (t ^ 1) * FA_ROWS, lse, dsum, bh, T, n0);
            }
            /* i0 >= j0 and first <= j0 + 48: the tile always has queries i >= a warp key */
            float p[8][4], dp[8][4];
            fm_scores<T16, HD>(p, ka, Qs, lane); /* S^T: keys x queries */
            fm_each(
                i0 >= j0 + FA_ROWS && i0 + FA_ROWS <= T, /* every query after every key */
                [&](int n, int e) {
                    const int i = i0 + 8 * n + 2 * quad + (e & 1), j = key[e >> 1];
                    return i >= j && i < T && j < T;
                },
                [&](int n, int e, bool keep) {
                    const int col = 8 * n + 2 * quad + (e & 1);
                    p[n][e] = keep ? fm_exp2(p[n][e] * sl2 - ls[col]) : 0.f;
                });
            fm_scores<T16, HD>(dp, va, Gs, lane); /* dP^T = V dO^T */
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    dp[n][e] = p[n][e] * (dp[n][e] - Ds[8 * n + 2 * quad + (e & 1)]); /* dS^T */
            fm_pv<T16, HD>(dva, p, Gs, lane);  /* dV += P^T dO */
            fm_pv<T16, HD>(dka, dp, Qs, lane); /* dK += dS^T Q */
            fm_wait_all();
            __syncthreads();
        }
        fm_store_rows<T16, HD>(dv, base, ld, first, T, Hd, 1.f, dva, lane, dv16);
        fm_store_rows<T16, HD>(dk, base, ld, first, T, Hd, scale, dka, lane, dk16);
    }
}

/* ---- dispatch ---- */

/* The device's compute capability and opt-in shared memory per block, asked once (the
 * backend uses one device). */
static void fa_device(int *cc, int *smem_max)
{
    static int got, cap, smax;
    if (!got) {
        int dev = 0, major = 0, minor = 0;
        if (!MOE_CUDA_OK(cudaGetDevice(&dev)) ||
            !MOE_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) ||
            !MOE_CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) ||
            !MOE_CUDA_OK(
                cudaDeviceGetAttribute(&smax, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) {
            cap = smax = 0;
        } else {
            cap = major * 10 + minor;
        }
        got = 1;
    }
    *cc = cap;
    *smem_max = smax;
}

/* The precision of the tensor-core path for this call: MOE_PREC_BF16 / FP16, or
 * MOE_PREC_FP32 when the fp32 kernels must run (see the section's comment). */
static moe_precision fa_precision(int Hd, size_t smem, const void *const *ptrs, int n)
{
    const moe_precision p = cuda_gemm_precision();
    if (p == MOE_PREC_FP32 || Hd % 16 != 0 || Hd > 128)
        return MOE_PREC_FP32;
    for (int a = 0; a < n; a++)
        if ((uintptr_t)ptrs[a] % 16 != 0)
            return MOE_PREC_FP32;
    int cc, smem_max;
    fa_device(&cc, &smem_max);
    if ((p == MOE_PREC_BF16 && cc < 80) || smem > (size_t)smem_max)
        return MOE_PREC_FP32;
    return p;
}

/* Lets kernel take smem bytes of dynamic shared memory; 0 (recorded) on failure. */
static int fa_smem(const void *kernel, size_t smem)
{
    if (smem <= 48 * 1024)
        return 1;
    return MOE_CUDA_OK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
}

/* The kernel family for this device: 1 for the mma.sync kernels (sm_80 and later), 0 for
 * wmma; MOE_ATTENTION=wmma in the environment picks wmma anywhere. */
static int fm_family(void)
{
    int cc, smem_max;
    fa_device(&cc, &smem_max);
    const char *e = getenv("MOE_ATTENTION");
    return cc >= 80 && !(e && strcmp(e, "wmma") == 0);
}

/* The wgmma kernels of sm90/attention_wgmma.cu (built where the architectures include
 * 90: MOE_HAVE_SM90A) run on compute capability 9.0 for head dim 64, unless
 * MOE_ATTENTION=mma (or wmma) in the environment keeps the mma.sync (wmma) kernels. */
#if MOE_HAVE_SM90A
#include "kernels/cuda/sm90/attention_wgmma.h"
#endif
static int fw_family(void)
{
#if MOE_HAVE_SM90A
    int cc, smem_max;
    fa_device(&cc, &smem_max);
    const char *e = getenv("MOE_ATTENTION");
    return cc == 90 && fm_family() && !(e && strcmp(e, "mma") == 0);
#else
    return 0;
#endif
}

/* Whether the attention runs on the wgmma kernels here (for tests). */
extern "C" int moe_cuda_attention_wgmma(void) { return fw_family(); }

#if MOE_HAVE_SM90A
/* Warpgroups a block of a wgmma kernel: the environment's name = 1 or 2, else dflt (a
 * benchmark knob: MOE_ATTENTION_WG for the forward, default 2, MOE_ATTENTION_DQ_WG
 * for dq, default 1, MOE_ATTENTION_DKV_WG for dk/dv, default 1). */
static int fw_env_wg(const char *name, int dflt)
{
    const char *e = getenv(name);
    return e && strcmp(e, "1") == 0 ? 1 : e && strcmp(e, "2") == 0 ? 2 : dflt;
}

/* The buffers of the wgmma dk/dv kernel's walk: MOE_ATTENTION_DKV_STAGES = 2 or 3 (a
 * benchmark knob), default 2. */
static int fw_env_stages(void)
{
    const char *e = getenv("MOE_ATTENTION_DKV_STAGES");
    return e && strcmp(e, "3") == 0 ? 3 : 2;
}
#endif

static void fw_forward(int bf16, real *out, real *lse, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, int B, int T, int H, int o16)
{
#if MOE_HAVE_SM90A
    cuda_wgmma_attention_forward(bf16, out, lse, q, k, v, B, T, H, o16,
                                 fw_env_wg("MOE_ATTENTION_WG", 2));
#else
    (void)bf16, (void)out, (void)lse, (void)q, (void)k, (void)v, (void)B, (void)T, (void)H,
        (void)o16;
    MOE_CUDA_FAIL("attention: the wgmma kernels are not built in");
#endif
}

/* The wgmma backward (fw_env_wg: the warpgroups a block of dq and of dk/dv). */
static void fw_backward(int bf16, real *dq, real *dk, real *dv, const uint16_t *dout,
                        const real *lse, const float *dsum, const uint16_t *q, const uint16_t *k,
                        const uint16_t *v, int B, int T, int H, int m16, const att_rope_out *ro)
{
#if MOE_HAVE_SM90A
    if (cuda_wgmma_attention_backward(
            bf16, dq, dk, dv, dout, lse, dsum, q, k, v, B, T, H, (m16 & ATT_DQ16) != 0,
            (m16 & ATT_DK16) != 0, (m16 & ATT_DV16) != 0, fw_env_wg("MOE_ATTENTION_DQ_WG", 1),
            fw_env_wg("MOE_ATTENTION_DKV_WG", 1), fw_env_stages(), ro ? ro->dqkv : NULL,
            ro ? ro->cos_t : NULL, ro ? ro->sin_t : NULL) &&
        ro)
        *ro->fused = 1;
#else
    (void)bf16, (void)dq, (void)dk, (void)dv, (void)dout, (void)lse, (void)dsum, (void)q, (void)k,
        (void)v, (void)B, (void)T, (void)H, (void)m16, (void)ro;
    MOE_CUDA_FAIL("attention backward: the wgmma kernels are not built in");
#endif
}

/* m16 (ATT_*16): q, k, v hold 16-bit values (marked, cuda_attention_operands16), which
 * the mma.sync kernels read as they are; out gets 16-bit values. */
template <class T16, int HD, int FM>
static void flash_forward_run(real *out, real *lse, const real *q, const real *k, const real *v,
                              int B, int T, int H, int Hd, int m16)
{
    const int mt = FM ? fm_forward_mt(HD) : 1, br = FA_ROWS * mt; /* queries per block */
    const dim3 grid((unsigned)(B * H), (unsigned)((T + br - 1) / br));
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)Hd));
    if constexpr (FM) { /* from 16-bit copies of q, k, v in the scratch, or q, k, v */
        void (*kernel)(real *, real *, const T16 *, const T16 *, const T16 *, int, int, int, float,
                       int) = mt == 2 ? fm_forward_kernel<T16, HD, (HD == 64 ? 2 : 1)>
                                      : fm_forward_kernel<T16, HD, 1>;
        const size_t n = (size_t)B * T * H * Hd, smem = fm_forward_smem(HD);
        const int o16 = (m16 & ATT_OUT16) != 0, wgmma = HD == 64 && Hd == 64 && fw_family();
        if (!wgmma && !fa_smem((const void *)kernel, smem))
            return;
        const uint16_t *q16 = (const uint16_t *)q, *k16 = (const uint16_t *)k,
                       *v16 = (const uint16_t *)v;
        if (!(m16 & ATT_QKV16)) {
            uint16_t *c = (uint16_t *)moe_cuda_scratch(sizeof(uint16_t) * 3 * n);
            if (!c)
                return;
            cuda_round_operand(c, q, n);
            cuda_round_operand(c + n, k, n);
            cuda_round_operand(c + 2 * n, v, n);
            q16 = c;
            k16 = c + n;
            v16 = c + 2 * n;
        }
        if (wgmma)
            fw_forward(std::is_same<T16, __nv_bfloat16>::value, out, lse, q16, k16, v16, B, T, H,
                       o16);
        else
            MOE_CUDA_LAUNCH(kernel, grid, FA_THREADS, smem, out, lse, (const T16 *)q16,
                            (const T16 *)k16, (const T16 *)v16, T, H, Hd, sl2, o16);
    } else {
        (void)m16; /* never set without the mma.sync kernels */
        void (*kernel)(real *, real *, const real *, const real *, const real *, int, int, int,
                       float) = flash_forward_kernel<T16, HD>;
        const size_t smem = fa_forward_smem(HD);
        if (!fa_smem((const void *)kernel, smem))
            return;
        MOE_CUDA_LAUNCH(kernel, grid, FA_THREADS, smem, out, lse, q, k, v, T, H, Hd, sl2);
    }
}

/* c16: room for the FM kernels' 16-bit copies of q, k, v and dout, B*T*H*Hd values each,
 * of those not marked (m16: ATT_*16): q, k, v's first, then dout's. */
template <class T16, int HD, int FM>
static void flash_backward_run(real *dq, real *dk, real *dv, const real *dout, const real *lse,
                               const float *dsum, const real *q, const real *k, const real *v,
                               int B, int T, int H, int Hd, uint16_t *c16, int m16,
                               const att_rope_out *ro)
{
    const float scale = (float)(1.0 / sqrt((double)Hd));
    const float sl2 = (float)(1.4426950408889634 / sqrt((double)Hd));
    const dim3 grid((unsigned)(B * H), (unsigned)((T + FA_ROWS - 1) / FA_ROWS));
    if constexpr (FM) {
        void (*kdq)(real *, const T16 *, const real *, const float *, const T16 *, const T16 *,
                    const T16 *, int, int, int, float, float, int) = fm_dq_kernel<T16, HD>;
        void (*kdkv)(real *, real *, const T16 *, const real *, const float *, const T16 *,
                     const T16 *, const T16 *, int, int, int, float, float, int, int) =
            fm_dkv_kernel<T16, HD>;
        const size_t n = (size_t)B * T * H * Hd, smem = fm_backward_smem(HD);
        if (!fa_smem((const void *)kdq, smem) || !fa_smem((const void *)kdkv, smem))
            return;
        const T16 *q16 = (const T16 *)q, *k16 = (const T16 *)k, *v16 = (const T16 *)v;
        const T16 *g16 = (const T16 *)dout;
        uint16_t *next = c16; /* the copies of what is not marked */
        if (!(m16 & ATT_QKV16)) {
            cuda_round_operand(next, q, n);
            cuda_round_operand(next + n, k, n);
            cuda_round_operand(next + 2 * n, v, n);
            q16 = (const T16 *)next;
            k16 = q16 + n;
            v16 = k16 + n;
            next += 3 * n;
        }
        if (!(m16 & ATT_DOUT16)) {
            cuda_round_operand(next, dout, n);
            g16 = (const T16 *)next;
        }
        if (HD == 64 && Hd == 64 && fw_family()) {
            fw_backward(std::is_same<T16, __nv_bfloat16>::value, dq, dk, dv, (const uint16_t *)g16,
                        lse, dsum, (const uint16_t *)q16, (const uint16_t *)k16,
                        (const uint16_t *)v16, B, T, H, m16, ro);
            return;
        }
        if (dq)
            MOE_CUDA_LAUNCH(kdq, grid, FA_THREADS, smem, dq, g16, lse, dsum, q16, k16, v16, T, H,
                            Hd, scale, sl2, (m16 & ATT_DQ16) != 0);
        if (dk || dv)
            MOE_CUDA_LAUNCH(kdkv, grid, FA_THREADS, smem, dk, dv, g16, lse, dsum, q16, k16, v16, T,
                            H, Hd, scale, sl2, (m16 & ATT_DK16) != 0, (m16 & ATT_DV16) != 0);
    } else {
        (void)m16; /* never set without the mma.sync kernels */
        void (*kdq)(real *, const real *, const real *, const float *, const real *, const real *,
                    const real *, int, int, int, float, float) = flash_dq_kernel<T16, HD>;
        void (*kdkv)(real *, real *, const real *, const real *, const float *, const real *,
                     const real *, const real *, int, int, int, float, float) =
            flash_dkv_kernel<T16, HD>;
        const size_t smem = fa_backward_smem(HD);
        if (dq && fa_smem((const void *)kdq, smem))
            MOE_CUDA_LAUNCH(kdq, grid, FA_THREADS, smem, dq, dout, lse, dsum, q, k, v, T, H, Hd,
                            scale, sl2);
        if ((dk || dv) && fa_smem((const void *)kdkv, smem))
            MOE_CUDA_LAUNCH(kdkv, grid, FA_THREADS, smem, dk, dv, dout, lse, dsum, q, k, v, T, H,
                            Hd, scale, sl2);
    }
}

/* The instance for precision p, padded head dim HD and kernel family fm. */
static void flash_forward_pick(moe_precision p, int HD, int fm, real *out, real *lse, const real *q,
                               const real *k, const real *v, int B, int T, int H, int Hd, int m16)
{
    typedef __nv_bfloat16 bf;
    if (p == MOE_PREC_BF16)
        (HD == 64 ? (fm ? flash_forward_run<bf, 64, 1> : flash_forward_run<bf, 64, 0>)
                  : (fm ? flash_forward_run<bf, 128, 1> : flash_forward_run<bf, 128, 0>))(
            out, lse, q, k, v, B, T, H, Hd, m16);
    else
        (HD == 64 ? (fm ? flash_forward_run<__half, 64, 1> : flash_forward_run<__half, 64, 0>)
                  : (fm ? flash_forward_run<__half, 128, 1> : flash_forward_run<__half, 128, 0>))(
            out, lse, q, k, v, B, T, H, Hd, m16);
}

static void flash_backward_pick(moe_precision p, int HD, int fm, real *dq, real *dk, real *dv,
                                const real *dout, const real *lse, const float *dsum, const real *q,
                                const real *k, const real *v, int B, int T, int H, int Hd,
                                uint16_t *c16, int m16, const att_rope_out *ro)
{
    typedef __nv_bfloat16 bf;
    if (p == MOE_PREC_BF16)
        (HD == 64 ? (fm ? flash_backward_run<bf, 64, 1> : flash_backward_run<bf, 64, 0>)
                  : (fm ? flash_backward_run<bf, 128, 1> : flash_backward_run<bf, 128, 0>))(
            dq, dk, dv, dout, lse, dsum, q, k, v, B, T, H, Hd, c16, m16, ro);
    else
        (HD == 64 ? (fm ? flash_backward_run<__half, 64, 1> : flash_backward_run<__half, 64, 0>)
                  : (fm ? flash_backward_run<__half, 128, 1> : flash_backward_run<__half, 128, 0>))(
            dq, dk, dv, dout, lse, dsum, q, k, v, B, T, H, Hd, c16, m16, ro);
}

/* The ATT_*16 flags of the buffers given (NULL: not marked; n elements each), or -1 (a
 * failure, recorded) where q, k, v are not all marked or all unmarked. */
static int att_marks(const real *q, const real *k, const real *v, const real *out, const real *dout,
                     const real *dq, const real *dk, const real *dv, size_t n)
{
    int bf16 = 0;
    const int a = cuda_operand_in_place(q, n, &bf16), b = cuda_operand_in_place(k, n, &bf16),
              c = cuda_operand_in_place(v, n, &bf16);
    if (a != b || b != c) {
        MOE_CUDA_FAIL("attention: q, k, v must all be marked as 16-bit, or none");
        return -1;
    }
    const real *const ptr[5] = {out, dout, dq, dk, dv};
    static const int flag[5] = {ATT_OUT16, ATT_DOUT16, ATT_DQ16, ATT_DK16, ATT_DV16};
    int m16 = a ? ATT_QKV16 : 0;
    for (int i = 0; i < 5; i++)
        if (cuda_operand_in_place(ptr[i], n, &bf16))
            m16 |= flag[i];
    return m16;
}

/* m16: the ATT_*16 flags; only the mma.sync kernels take marked buffers (else a failure,
 * recorded, and 1: nothing else may take them). */
static int flash_forward(real *out, real *lse, const real *q, const real *k, const real *v, int B,
                         int T, int H, int Hd, int m16)
{
    const int HD = Hd <= 64 ? 64 : 128, fm = fm_family();
    const void *ptrs[4] = {out, q, k, v};
    const moe_precision p =
        fa_precision(Hd, fm ? fm_forward_smem(HD) : fa_forward_smem(HD), ptrs, 4);
    if (m16 && (p == MOE_PREC_FP32 || !fm)) {
        MOE_CUDA_FAIL("attention: 16-bit buffers need the mma.sync kernels (Hd %d)", Hd);
        return 1;
    }
    if (p == MOE_PREC_FP32)
        return 0;
    flash_forward_pick(p, HD, fm, out, lse, q, k, v, B, T, H, Hd, m16);
    return 1;
}

extern "C" int cuda_attention_operands16(int Hd)
{
    int cc, smem_max;
    fa_device(&cc, &smem_max);
    const int HD = Hd <= 64 ? 64 : 128;
    return fm_family() && Hd % 16 == 0 && Hd <= 128 && fm_forward_smem(HD) <= (size_t)smem_max &&
           fm_backward_smem(HD) <= (size_t)smem_max;
}

/* Whether the backward's tensor-core path, if taken, runs the mma.sync kernels: a 16-bit
 * precision on the mma.sync family. flash_backward picks its kernels by this and
 * flash_backward_copies sizes c16 by it, so the two cannot disagree (the copies get room
 * even when fa_precision then sends the op to the fp32 kernels). */
static int fm_backward_used(void) { return cuda_gemm_precision() != MOE_PREC_FP32 && fm_family(); }

/* The 16-bit values flash_backward needs room for in c16: for the mma.sync kernels a copy
 * of each of q, k, v and dout that is not marked (m16: ATT_*16); else none. */
static size_t flash_backward_copies(int B, int T, int H, int Hd, int m16)
{
    const int copies = (m16 & ATT_QKV16 ? 0 : 3) + (m16 & ATT_DOUT16 ? 0 : 1);
    return fm_backward_used() ? copies * (size_t)B * T * H * Hd : 0;
}

static int flash_backward(real *dq, real *dk, real *dv, const real *dout, const real *lse,
                          const float *dsum, const real *q, const real *k, const real *v, int B,
                          int T, int H, int Hd, uint16_t *c16, int m16, const att_rope_out *ro)
{
    const int HD = Hd <= 64 ? 64 : 128, fm = fm_backward_used();
    const void *ptrs[7] = {dq, dk, dv, dout, q, k, v};
    const moe_precision p =
        fa_precision(Hd, fm ? fm_backward_smem(HD) : fa_backward_smem(HD), ptrs, 7);
    const int no_room = fm && flash_backward_copies(B, T, H, Hd, m16) > 0 && !c16;
    /* out is read by the dsum kernel alone: its mark needs nothing here */
    if ((m16 & ~ATT_OUT16) && (p == MOE_PREC_FP32 || !fm || no_room)) {
        MOE_CUDA_FAIL("attention backward: 16-bit buffers need the mma.sync kernels (Hd %d)", Hd);
        return 1;
    }
    if (p == MOE_PREC_FP32 || no_room)
        return 0;
    flash_backward_pick(p, HD, fm, dq, dk, dv, dout, lse, dsum, q, k, v, B, T, H, Hd, c16, m16, ro);
    return 1;
}
