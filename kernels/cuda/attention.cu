/* kernels/cuda/attention.cu: fused causal multi-head attention, scale 1/sqrt(Hd), for
 * any T >= 1 and Hd <= 128. The T x T scores are never stored.
 *
 * Forward: a block holds ATT_WARPS consecutive queries of one (sequence, head), one per
 * warp, and walks the keys in tiles of 32 staged in shared memory; lane l scores key
 * j0 + l, the warp keeps a running max and sum (online softmax) and each lane
 * accumulates Hd/32 output dims. lse (B, H, T) is saved.
 * Backward (deterministic, no atomics): Di = dout_i . out_i; dq by query rows (the same
 * walk over key tiles, recomputing p from lse); dk and dv by key rows, each warp one key
 * walking the query tiles from that key on. Every gradient row is one sum, added once. */
#include "kernels/cuda/cuda_common.cuh"

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
    const size_t smem = sizeof(float) * ((size_t)ATT_TILE * (Hd + 1) + (size_t)ATT_TILE * Hd +
                                         (size_t)ATT_WARPS * Hd);
    const dim3 grid((T + ATT_WARPS - 1) / ATT_WARPS, H, B);
    MOE_CUDA_LAUNCH(attention_forward_kernel, grid, ATT_THREADS, smem, out, lse, q, k, v, T, H, Hd,
                    (float)(1.0 / sqrt((double)Hd)));
}

/* ---- backward ------------------------------------------------------------------------ */

/* dsum (B, H, T) = dout_i . out_i, one warp per (sequence, head, query). */
static __global__ void attention_dsum_kernel(float *dsum, const real *dout, const real *out, int B,
                                             int T, int H, int Hd)
{
    const size_t w = (size_t)blockIdx.x * ATT_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (w >= (size_t)B * H * T)
        return;
    const int i = (int)(w % T);
    const size_t bh = w / T, b = bh / H, h = bh % H;
    const size_t off = (b * T + i) * (size_t)H * Hd + h * Hd;
    double s = 0.0;
    for (int d = lane; d < Hd; d += 32)
        s += (double)dout[off + d] * out[off + d];
    s = moe_warp_sum_d(s);
    if (lane == 0)
        dsum[w] = (float)s;
}

/* dq_i += scale * sum_{j <= i} p_ij (dout_i . v_j - D_i) k_j, one warp per query. */
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
            dq[base + (size_t)i * ld + d] += scale * acc[c];
    }
}

/* dk_j += scale * sum_{i >= j} ds_ij q_i ; dv_j += sum_{i >= j} p_ij dout_i, one warp per
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
            dk[base + (size_t)j * ld + d] += scale * acck[c];
        if (dv)
            dv[base + (size_t)j * ld + d] += accv[c];
    }
}

extern "C" void cuda_attention_backward(real *dq, real *dk, real *dv, const real *dout,
                                        const real *out, const real *lse, const real *q,
                                        const real *k, const real *v, int B, int T, int H, int Hd)
{
    if (B <= 0 || T <= 0 || H <= 0 || Hd <= 0 || (!dq && !dk && !dv) || !head_dim_ok(Hd))
        return;
    const size_t rows = (size_t)B * H * T;
    float *dsum = (float *)moe_cuda_scratch(sizeof(float) * rows);
    if (!dsum)
        return;
    const float scale = (float)(1.0 / sqrt((double)Hd));
    MOE_CUDA_LAUNCH(attention_dsum_kernel, (unsigned)((rows + ATT_WARPS - 1) / ATT_WARPS),
                    ATT_THREADS, 0, dsum, dout, out, B, T, H, Hd);
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
