/* kernels/cuda/rmsnorm.cu: RMSNorm, out = x / sqrt(mean(x^2) + eps) * weight, and its
 * backward. Row sums in double as the CPU reference, over tx threads per row (a warp for
 * short rows, a whole block for long ones); the forward keeps float4 rows up to D = 4096
 * in registers, else few rows are in flight, and the second pass over a row finds it in
 * cache. dweight, a sum over rows, is a deterministic
 * two-stage reduction: per chunk of rows a partial column sum (fixed order inside the
 * block), then the chunks (fixed order too). No atomics. Where it can (float4 rows up to
 * D = 4096), the backward makes one pass over x and dout for dx and dweight together. */
#include <stdlib.h>

#include "kernels/cuda/cuda_common.cuh"

#define DW_CHUNK 256 /* rows per partial sum of dweight */
#define DW_COLS 32
#define DW_LANES 8 /* threads per column in a block */

static_assert(sizeof(real) == sizeof(float), "the float4 forms read real as float");

/* Every kernel below takes V (moe_fvec, cuda_common.cuh): 4 where D % 4 == 0 and the
 * pointers are 16-byte aligned (the runtime's rows), else 1; the arithmetic per element is
 * the same.
 *
 * Groups of V elements per thread the row blocks aim at: enough loads in flight per
 * thread to cover the memory latency, few enough rows in flight that the second pass over
 * a row hits the cache (measured on an H200 at D = 1024: fwd 2, dx 4 best, within a few
 * percent). */
#define FWD_GROUPS 2
#define DX_GROUPS 4

/* Block (tx, ty) for rows of `groups` V-groups, about `per_thread` groups per thread: ty
 * rows, tx threads on each (a multiple of 32, at most MOE_CUDA_THREADS). */
static dim3 row_block(int groups, int per_thread)
{
    int tx = (groups + per_thread - 1) / per_thread;
    tx = tx >= MOE_CUDA_THREADS ? MOE_CUDA_THREADS : (tx + 31) / 32 * 32;
    return dim3(tx, MOE_CUDA_THREADS / tx);
}

/* Sum of v over the tx threads of each row of a row_block, in a fixed order (so the bits
 * do not depend on scheduling); every thread of the row gets it. Contains
 * __syncthreads(): every thread of the block calls it, once per kernel. */
static __device__ __forceinline__ double row_sum(double v)
{
    __shared__ double part[MOE_CUDA_THREADS / 32];
    const int warps = blockDim.x >> 5, first = threadIdx.y * warps; /* the row's slots */
    v = moe_warp_sum_d(v);
    if ((threadIdx.x & 31) == 0)
        part[first + (threadIdx.x >> 5)] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < warps; w++)
        s += part[first + w];
    return s;
}

/* O16: out is marked as holding its GEMM operand: the 16-bit values go there instead. */
template <int V, bool O16>
static __global__ void rmsnorm_forward_kernel(real *out, real *rstd, const real *x,
                                              const real *weight, int N, int D, real eps, int bf16)
{
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int live = row < N; /* the others still reach row_sum's barrier */
    const real *xr = x + (size_t)row * D;
    real *o = out + (size_t)row * D;
    double ss = 0.0;
    if (live) {
#pragma unroll 4
        for (int d = threadIdx.x * V; d < D; d += blockDim.x * V) {
            const moe_fvec<V> xv = moe_load_v<V>(xr + d);
#pragma unroll
            for (int k = 0; k < V; k++)
                ss += (double)xv.v[k] * xv.v[k];
        }
    }
    ss = row_sum(ss);
    if (!live)
        return;
    const double r = 1.0 / sqrt(ss / D + (double)eps);
#pragma unroll 4
    for (int d = threadIdx.x * V; d < D; d += blockDim.x * V) {
        const moe_fvec<V> xv = moe_load_v<V>(xr + d), w = moe_load_v<V>(weight + d);
        moe_fvec<V> ov;
#pragma unroll
        for (int k = 0; k < V; k++)
            ov.v[k] = (real)(xv.v[k] * r * w.v[k]);
        if (O16)
            moe_store16_v<V>((uint16_t *)out + (size_t)row * D + d, ov, bf16);
        else
            moe_store_v<V>(o + d, ov);
    }
    if (threadIdx.x == 0)
        rstd[row] = (real)r;
}

/* The forward with the row in registers (V = 4): each of a row's tx threads holds up to G
 * groups, d = 4 (threadIdx.x + q tx), read once; the squares are summed in the order of
 * rmsnorm_forward_kernel at the same block (so the same bits) and the output is written
 * from the registers, without the second pass over x. D <= 4 tx G. (Measured on an H200
 * at D = 1024: 78% of device copy; loading the weights before the barrier too made it
 * 60%, and a row per warp without the barrier 56%.) */
template <int G, bool O16>
static __global__ void rmsnorm_forward_regs_kernel(real *out, real *rstd, const real *x,
                                                   const real *weight, int N, int D, real eps,
                                                   int bf16)
{
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int live = row < N;
    const real *xr = x + (size_t)row * D;
    moe_fvec<4> xv[G];
    double ss = 0.0;
#pragma unroll
    for (int q = 0; q < G; q++) {
        const int d = (threadIdx.x + q * blockDim.x) * 4;
        if (live && d < D) {
            xv[q] = moe_load_v<4>(xr + d);
#pragma unroll
            for (int k = 0; k < 4; k++)
                ss += (double)xv[q].v[k] * xv[q].v[k];
        }
    }
    ss = row_sum(ss);
    if (!live)
        return;
    const double r = 1.0 / sqrt(ss / D + (double)eps);
#pragma unroll
    for (int q = 0; q < G; q++) {
        const int d = (threadIdx.x + q * blockDim.x) * 4;
        if (d >= D)
            continue;
        const moe_fvec<4> w = moe_load_v<4>(weight + d);
        moe_fvec<4> ov;
#pragma unroll
        for (int k = 0; k < 4; k++)
            ov.v[k] = (real)(xv[q].v[k] * r * w.v[k]);
        if (O16)
            moe_store16_v<4>((uint16_t *)out + (size_t)row * D + d, ov, bf16);
        else
            moe_store_v<4>(out + (size_t)row * D + d, ov);
    }
    if (threadIdx.x == 0)
        rstd[row] = (real)r;
}

extern "C" void cuda_rmsnorm_forward(real *out, real *rstd, const real *x, const real *weight,
                                     int N, int D, real eps)
{
    if (N <= 0 || D <= 0)
        return;
    int bf16 = 0;
    const bool o16 = cuda_operand_in_place(out, (size_t)N * D, &bf16);
    const int v4 = D % 4 == 0 && moe_aligned16(out) && moe_aligned16(x) && moe_aligned16(weight);
    const dim3 block = row_block(v4 ? D / 4 : D, FWD_GROUPS);
    const unsigned grid = (N + block.y - 1) / block.y;
    const int per_thread = v4 ? (D / 4 + (int)block.x - 1) / (int)block.x : 0;
    if (v4 && per_thread <= 4) { /* the row in registers (up to D = 4096) */
        moe_cuda_pick(
            [&](auto two, auto o16_) {
                constexpr int G = decltype(two)::value ? 2 : 4;
                constexpr bool O16 = decltype(o16_)::value;
                MOE_CUDA_LAUNCH((rmsnorm_forward_regs_kernel<G, O16>), grid, block, 0, out, rstd, x,
                                weight, N, D, eps, bf16);
            },
            per_thread <= 2, o16);
        return;
    }
#define RMS_FORWARD(V, O16)                                                                        \
    MOE_CUDA_LAUNCH((rmsnorm_forward_kernel<V, O16>), grid, block, 0, out, rstd, x, weight, N, D,  \
                    eps, bf16)
    MOE_CUDA_PICK2(v4, o16, RMS_FORWARD, 4, 1, true, false);
#undef RMS_FORWARD
}

/* dx_d += r * (w_d g_d - x_d * r^2 * sum_j(w_j g_j x_j) / D) (write: =); rows as the
 * forward's. */
template <int V>
static __global__ void rmsnorm_backward_dx_kernel(real *dx, const real *dout, const real *x,
                                                  const real *weight, const real *rstd, int N,
                                                  int D, int write)
{
    const int row = blockIdx.x * blockDim.y + threadIdx.y;
    const int live = row < N;
    const real *xr = x + (size_t)row * D, *g = dout + (size_t)row * D;
    real *dxr = dx + (size_t)row * D;
    const double r = live ? rstd[row] : 0.0; /* before the barrier: no wait after it */
    double dot = 0.0;
    if (live) {
#pragma unroll 4
        for (int d = threadIdx.x * V; d < D; d += blockDim.x * V) {
            const moe_fvec<V> w = moe_load_v<V>(weight + d), gv = moe_load_v<V>(g + d);
            const moe_fvec<V> xv = moe_load_v<V>(xr + d);
#pragma unroll
            for (int k = 0; k < V; k++)
                dot += (double)w.v[k] * gv.v[k] * xv.v[k];
        }
    }
    dot = row_sum(dot);
    if (!live)
        return;
    const double c = r * r * dot / D;
#pragma unroll 4
    for (int d = threadIdx.x * V; d < D; d += blockDim.x * V) {
        const moe_fvec<V> w = moe_load_v<V>(weight + d), gv = moe_load_v<V>(g + d),
                          xv = moe_load_v<V>(xr + d);
        moe_fvec<V> dv;
        if (write) {
#pragma unroll
            for (int k = 0; k < V; k++)
                dv.v[k] = 0;
        } else {
            dv = moe_load_v<V>(dxr + d);
        }
#pragma unroll
        for (int k = 0; k < V; k++)
            dv.v[k] += (real)(r * ((double)w.v[k] * gv.v[k] - xv.v[k] * c));
        moe_store_v<V>(dxr + d, dv);
    }
}

/* part[chunk][d] = sum over the chunk's rows n of g_nd x_nd r_n: block (DW_COLS, DW_LANES),
 * each thread V adjacent columns over a strided subset of the rows, then the DW_LANES
 * partials in order (the same order for any V). */
template <int V>
static __global__ void rmsnorm_dweight_partial(double *part, const real *dout, const real *x,
                                               const real *rstd, int N, int D)
{
    __shared__ double acc[DW_LANES][DW_COLS * V];
    const int d = (blockIdx.x * DW_COLS + threadIdx.x) * V, chunk = blockIdx.y;
    const int lo = chunk * DW_CHUNK, hi = min(N, lo + DW_CHUNK);
    double s[V];
#pragma unroll
    for (int k = 0; k < V; k++)
        s[k] = 0.0;
    if (d < D) /* V = 4: D % 4 == 0, so the whole group is inside */
        for (int n = lo + threadIdx.y; n < hi; n += DW_LANES) {
            const moe_fvec<V> gv = moe_load_v<V>(dout + (size_t)n * D + d);
            const moe_fvec<V> xv = moe_load_v<V>(x + (size_t)n * D + d);
            const double r = rstd[n];
#pragma unroll
            for (int k = 0; k < V; k++)
                s[k] += (double)gv.v[k] * xv.v[k] * r;
        }
#pragma unroll
    for (int k = 0; k < V; k++)
        acc[threadIdx.y][threadIdx.x * V + k] = s[k];
    __syncthreads();
    if (threadIdx.y == 0 && d < D) {
#pragma unroll
        for (int k = 0; k < V; k++) {
            double t = 0.0;
            for (int l = 0; l < DW_LANES; l++)
                t += acc[l][threadIdx.x * V + k];
            part[(size_t)chunk * D + d + k] = t;
        }
    }
}

/* The backward in one pass over x and dout (D % 4 == 0, aligned, D <= 4 * FUSED_THREADS *
 * FUSED_GROUPS): block b takes rows [b rows, ...) one after another, its FUSED_THREADS
 * threads each FUSED_GROUPS float4 groups of columns (their weights loaded once). Per row:
 * the dot product (per thread in column order, then the warps in order, in double), dx,
 * and each column's g x r added to the thread's partial of dweight, which goes to
 * part[b][d] at the end (rmsnorm_dweight_final adds the blocks in order). The two-kernel
 * form reads x and dout a second time for dweight. write_dx: dx is written, not read.
 * dx16 (not NULL): dx's values rounded to 16 bits (bf16 or fp16) stored there too, as the
 * GEMM operand of the residual gradient (a rounding pass of its own reads dx again). */
#define FUSED_THREADS 256
#define FUSED_GROUPS 4 /* the most; the kernel is built for 1, 2 and 4 */
/* Rows a block, by default (MOE_RMSNORM_ROWS): at D = 1024 on an H200 (N = 16384, 4
 * blocks an SM) 32 rows took 79.4% of copy bandwidth, 16 rows 76.6% (twice the partials),
 * 64 rows 59.5% (fewer blocks than the SMs hold). Issuing the next row's loads before a
 * row's barrier measured 77.6% / 75.6% at 32 / 16 rows: not kept. */
#define FUSED_ROWS 32

template <int G>
static __global__ void __launch_bounds__(FUSED_THREADS)
    rmsnorm_backward_fused_kernel(real *dx, uint2 *dx16, double *part, const real *dout,
                                  const real *x, const real *weight, const real *rstd, int N, int D,
                                  int rows, int write_dx, int bf16)
{
    __shared__ double red[2][FUSED_THREADS / 32];
    const int lo = blockIdx.x * rows, hi = min(N, lo + rows);
    const int warp = threadIdx.x >> 5, warps = FUSED_THREADS / 32;
    moe_fvec<4> w[G];
    double s[G][4];
#pragma unroll
    for (int q = 0; q < G; q++) {
        const int d = (threadIdx.x + q * FUSED_THREADS) * 4;
        if (d < D)
            w[q] = moe_load_v<4>(weight + d);
#pragma unroll
        for (int k = 0; k < 4; k++)
            s[q][k] = 0.0;
    }
    for (int n = lo, buf = 0; n < hi; n++, buf ^= 1) {
        const real *xr = x + (size_t)n * D, *g = dout + (size_t)n * D;
        real *dxr = dx + (size_t)n * D;
        moe_fvec<4> gv[G], xv[G], dv[G];
        const double r = rstd[n]; /* with the row's loads, not after the barrier */
        double dot = 0.0;
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int d = (threadIdx.x + q * FUSED_THREADS) * 4;
            if (d < D) {
                gv[q] = moe_load_v<4>(g + d);
                xv[q] = moe_load_v<4>(xr + d);
                if (write_dx) {
#pragma unroll
                    for (int k = 0; k < 4; k++)
                        dv[q].v[k] = 0;
                } else { /* with the others: one wait for memory a row */
                    dv[q] = moe_load_v<4>(dxr + d);
                }
#pragma unroll
                for (int k = 0; k < 4; k++)
                    dot += (double)w[q].v[k] * gv[q].v[k] * xv[q].v[k];
            }
        }
        dot = moe_warp_sum_d(dot);
        if ((threadIdx.x & 31) == 0)
            red[buf][warp] = dot;
        __syncthreads(); /* one per row: the other buffer serves the next row */
        dot = 0.0;
        for (int i = 0; i < warps; i++)
            dot += red[buf][i];
        const double c = r * r * dot / D;
#pragma unroll
        for (int q = 0; q < G; q++) {
            const int d = (threadIdx.x + q * FUSED_THREADS) * 4;
            if (d < D) {
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    dv[q].v[k] += (real)(r * ((double)w[q].v[k] * gv[q].v[k] - xv[q].v[k] * c));
                    s[q][k] += (double)gv[q].v[k] * xv[q].v[k] * r;
                }
                moe_store_v<4>(dxr + d, dv[q]);
                if (dx16)
                    dx16[((size_t)n * D + d) / 4] = moe_round16x4(
                        make_float4(dv[q].v[0], dv[q].v[1], dv[q].v[2], dv[q].v[3]), bf16);
            }
        }
    }
#pragma unroll
    for (int q = 0; q < G; q++) {
        const int d = (threadIdx.x + q * FUSED_THREADS) * 4;
        if (d < D)
#pragma unroll
            for (int k = 0; k < 4; k++)
                part[(size_t)blockIdx.x * D + d + k] = s[q][k];
    }
}

/* dweight[d] += (write: =) sum over the chunks of part[c][d]: block (FINAL_COLS, FINAL_LANES), each
 * thread a strided subset of the chunks, then the FINAL_LANES partials in order. Few
 * columns a block, so that D / FINAL_COLS blocks share the reading of the partials (32
 * columns a block made 32 blocks at D = 1024: 20 us for 8 MB of partials on an H200);
 * 4 doubles are one 32-byte sector. */
#define FINAL_COLS 4
#define FINAL_LANES 64
static __global__ void __launch_bounds__(FINAL_COLS *FINAL_LANES)
    rmsnorm_dweight_final(real *dweight, const double *part, int chunks, int D, int write)
{
    __shared__ double acc[FINAL_LANES][FINAL_COLS];
    const int d = blockIdx.x * FINAL_COLS + threadIdx.x;
    double s = 0.0;
    if (d < D)
#pragma unroll 8 /* several loads in flight a thread */
        for (int c = threadIdx.y; c < chunks; c += FINAL_LANES)
            s += part[(size_t)c * D + d];
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && d < D) {
        double t = 0.0;
        for (int l = 0; l < FINAL_LANES; l++)
            t += acc[l][threadIdx.x];
        dweight[d] = (real)t + (write ? (real)0 : dweight[d]);
    }
}

static void dweight_final(real *dweight, const double *part, int chunks, int D, int write)
{
    MOE_CUDA_LAUNCH(rmsnorm_dweight_final, (D + FINAL_COLS - 1) / FINAL_COLS,
                    dim3(FINAL_COLS, FINAL_LANES), 0, dweight, part, chunks, D, write);
}

/* dx16 (not NULL): dx's 16-bit values, as bf16 (bf16 != 0) or fp16, written there too. */
static void rmsnorm_backward_run(real *dx, uint16_t *dx16, int bf16, real *dweight,
                                 const real *dout, const real *x, const real *weight,
                                 const real *rstd, int N, int D, int write)
{
    const int write_dx = (write & MOE_WRITE_DX) != 0, write_dw = (write & MOE_WRITE_DW) != 0;
    /* x and dout feed both kernels: the float4 forms need them aligned */
    const bool vec = D % 4 == 0 && moe_aligned16(dout) && moe_aligned16(x);
    static int two_pass = -1; /* MOE_RMSNORM_TWO_PASS=1: the two-kernel form (a benchmark knob) */
    if (two_pass < 0)
        two_pass = getenv("MOE_RMSNORM_TWO_PASS") != NULL;
    if (dx && dweight && vec && moe_aligned16(dx) && moe_aligned16(weight) &&
        (uintptr_t)dx16 % 8 == 0 && D <= 4 * FUSED_THREADS * FUSED_GROUPS && !two_pass) {
        /* MOE_RMSNORM_ROWS=1..1024: rows a block (a benchmark knob, read each call: the tests
         * switch it) */
        const char *rows_env = getenv("MOE_RMSNORM_ROWS");
        int rows = rows_env ? atoi(rows_env) : FUSED_ROWS;
        rows = rows < 1 ? 1 : rows > 1024 ? 1024 : rows;
        const int blocks = (N + rows - 1) / rows;
        double *part = (double *)moe_cuda_scratch(sizeof(double) * (size_t)blocks * D);
        if (!part)
            return;
        const int groups = (D / 4 + FUSED_THREADS - 1) / FUSED_THREADS;
#define RMS_FUSED(G)                                                                               \
    MOE_CUDA_LAUNCH(rmsnorm_backward_fused_kernel<G>, blocks, FUSED_THREADS, 0, dx, (uint2 *)dx16, \
                    part, dout, x, weight, rstd, N, D, rows, write_dx, bf16)
        if (groups <= 1)
            RMS_FUSED(1);
        else if (groups <= 2)
            RMS_FUSED(2);
        else
            RMS_FUSED(4);
#undef RMS_FUSED
        dweight_final(dweight, part, blocks, D, write_dw);
        return;
    }
    if (dx && vec && moe_aligned16(dx) && moe_aligned16(weight)) {
        const dim3 rows = row_block(D / 4, DX_GROUPS);
        MOE_CUDA_LAUNCH(rmsnorm_backward_dx_kernel<4>, (N + rows.y - 1) / rows.y, rows, 0, dx, dout,
                        x, weight, rstd, N, D, write_dx);
    } else if (dx) {
        const dim3 rows = row_block(D, DX_GROUPS);
        MOE_CUDA_LAUNCH(rmsnorm_backward_dx_kernel<1>, (N + rows.y - 1) / rows.y, rows, 0, dx, dout,
                        x, weight, rstd, N, D, write_dx);
    }
    if (dx && dx16) /* the rounding pass the fused kernel saves */
        cuda_round_operand(dx16, dx, (size_t)N * D);
    if (!dweight)
        return;
    const int chunks = (N + DW_CHUNK - 1) / DW_CHUNK;
    double *part = (double *)moe_cuda_scratch(sizeof(double) * (size_t)chunks * D);
    if (!part)
        return;
    const dim3 block(DW_COLS, DW_LANES);
    if (vec)
        MOE_CUDA_LAUNCH(rmsnorm_dweight_partial<4>, dim3((D / 4 + DW_COLS - 1) / DW_COLS, chunks),
                        block, 0, part, dout, x, rstd, N, D);
    else
        MOE_CUDA_LAUNCH(rmsnorm_dweight_partial<1>, dim3((D + DW_COLS - 1) / DW_COLS, chunks),
                        block, 0, part, dout, x, rstd, N, D);
    dweight_final(dweight, part, chunks, D, write_dw);
}

/* dx_op: a marked buffer gets dx's 16-bit values (from the fused kernel where it runs, else
 * by a rounding pass after it), any other a copy of dx. */
extern "C" void cuda_rmsnorm_backward(real *dx, real *dweight, const real *dout, const real *x,
                                      const real *weight, const real *rstd, int N, int D, int write,
                                      real *dx_op)
{
    if (N <= 0 || D <= 0)
        return;
    int bf16 = 0;
    const size_t n = (size_t)N * D;
    const bool op16 = dx && dx_op && cuda_operand_in_place(dx_op, n, &bf16);
    rmsnorm_backward_run(dx, op16 ? (uint16_t *)dx_op : NULL, bf16, dweight, dout, x, weight, rstd,
                         N, D, write);
    if (dx && dx_op && !op16)
        MOE_CUDA_OK(cudaMemcpyAsync(dx_op, dx, sizeof(real) * n, cudaMemcpyDeviceToDevice,
                                    moe_cuda_stream()));
}
