/* kernels/cuda/sm90/wgmma.cuh: Hopper's warpgroup MMA (wgmma, sm_90a) for the attention
 * kernels of attention_wgmma.cu: 64 x 64 bf16 / fp16 tiles staged in shared memory in the
 * 128-byte swizzle the tensor cores read, their matrix descriptors, the m64n64k16 product
 * with A in registers, and the fences around it. Compiled for sm_90a only (CMakeLists.txt
 * builds this directory's sources for 90a-real when the architectures include 90).
 *
 * A tile is 64 rows of 64 16-bit values: 128 bytes a row, 8192 bytes, at a 1024-byte
 * aligned shared address. The 16-byte chunk c of row r sits at r * 128 + 16 (c ^ (r % 8)):
 * the 128-byte swizzle, which the hardware undoes from the address bits, so the tile must
 * start on a 1024-byte boundary. Read as B of a product, such a tile is either
 *  - K-major (its rows are B's n index, its columns the summed k index): the descriptor
 *    of the 16 columns 16 kk .. 16 kk + 15 starts 32 kk bytes in; or
 *  - MN-major (its rows are the summed k index, its columns B's n index; the transposed
 *    form, imm-trans-b 1): the 16 rows 16 kk .. start 2048 kk bytes in.
 * In both the 8-row groups are 1024 bytes apart (the stride byte offset); the leading
 * byte offset is unused with this swizzle at n = 64 (set to 1, as a 16-byte unit). */
#pragma once
/* After kernels/cuda/attention_mma.cuh (fm_pack). */
#include <stdint.h>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define FW_TILE 8192u /* bytes of a 64 x 64 16-bit tile */

/* The first 1024-byte aligned shared address at or after p (the tiles' start). */
static __device__ __forceinline__ unsigned fw_align1024(const void *p)
{
    return ((unsigned)__cvta_generic_to_shared(p) + 1023u) & ~1023u;
}

/* The descriptor of a swizzled tile's slice starting at shared address a. */
static __device__ __forceinline__ uint64_t fw_desc(unsigned a)
{
    return (uint64_t)((a & 0x3FFFFu) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
           ((uint64_t)1 << 62);
}

/* A walk's source: thread t's 16-byte column (t % 8) of row t / 8 in tile 0 of a 16-bit
 * matrix (row stride ld values, 64 columns from src). A walk computes it once, so that a
 * step's copies add one tile offset to it. */
struct fw_walk {
    const uint16_t *s;
    size_t ld;
};

template <int NT>
static __device__ __forceinline__ fw_walk fw_walk_at(const uint16_t *src, size_t ld)
{
    const int r = (int)threadIdx.x >> 3, c = (int)threadIdx.x & 7;
    return fw_walk{src + (size_t)r * ld + 8 * c, ld};
}

/* Rows [r0, r0 + 64) of a walk's matrix into the tile at shared address dst by cp.async
 * of 16 bytes, zero past T; the block's NT threads (blockDim.x == NT, a multiple of 64).
 * Thread t copies the 16-byte columns t % 8 of rows t / 8 + i NT / 8 (i < 512 / NT): its
 * swizzle (t / 8) % 8 and its offsets are the same in each pass, so the loop is unrolled
 * with no per-copy index work. A tile wholly before T (all but a sequence's last partial
 * one; block-uniform) copies without a row test; otherwise rows from T on copy 0 bytes
 * (from the matrix's first row, as fw_stage did). The caller commits the group. */
template <int NT>
static __device__ __forceinline__ void fw_stage_walk(unsigned dst, const fw_walk &w, int r0, int T)
{
    static_assert(NT % 64 == 0 && 512 % NT == 0, "fw_stage_walk: NT threads, rows 8 apart");
    constexpr int RS = NT / 8; /* rows a pass */
    const int r = (int)threadIdx.x >> 3, c = (int)threadIdx.x & 7;
    const unsigned d = dst + (unsigned)(r * 128 + ((c ^ (r & 7)) << 4));
    const uint16_t *s = w.s + (size_t)r0 * w.ld;
    if (r0 + 64 <= T) {
#pragma unroll
        for (int i = 0; i < 64 / RS; i++)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d + i * RS * 128),
                         "l"(s + (size_t)(i * RS) * w.ld));
        return;
    }
    const uint16_t *row0 = w.s - ((size_t)r * w.ld + 8 * c); /* the matrix's first row */
#pragma unroll
    for (int i = 0; i < 64 / RS; i++) {
        const int in = r0 + r + i * RS < T;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d + i * RS * 128),
                     "l"(in ? s + (size_t)(i * RS) * w.ld : row0), "r"(in ? 16 : 0));
    }
}

/* The same copies from src (a tile copied once, not walked). */
template <int NT>
static __device__ __forceinline__ void fw_stage(unsigned dst, const uint16_t *src, size_t ld,
                                                int r0, int T)
{
    fw_stage_walk<NT>(dst, fw_walk_at<NT>(src, ld), r0, T);
}

/* The raw statistics of query rows [i0, i0 + 64) of (sequence, head) bh, lse into st and
 * dsum into st + 64, by cp.async of 4 bytes from threads 0..63 (0 past T), in the
 * caller's group: the copies do not hold the threads up as loads into registers would
 * (the dk/dv kernel's stats were a load and a store, waited for every step). The reader
 * multiplies lse by log2(e) (__fmul_rn: the product fm_stage_stats stores). */
static __device__ __forceinline__ void fw_stage_stats(unsigned st, const real *lse,
                                                      const float *dsum, int bh, int T, int i0)
{
    if (threadIdx.x < 64) {
        const int i = i0 + (int)threadIdx.x, in = i < T;
        const size_t at = in ? (size_t)bh * T + i : 0;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 4 * threadIdx.x),
                     "l"(lse + at), "r"(in ? 4 : 0));
        asm volatile(
            "cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(st + 256 + 4 * threadIdx.x),
            "l"(dsum + at), "r"(in ? 4 : 0));
    }
}

/* d (64 x 64 fp32, this thread's 32) += a (the warpgroup's 64 x 16, registers) b (16 x 64,
 * the descriptor's slice); TB: b is MN-major. d[4 n + e] holds, in lane l of warp w of
 * the warpgroup, row 16 w + l / 4 + 8 (e / 2), column 8 n + 2 (l % 4) + e % 2. */
/* The accumulators' operands of the asm below (d, 32 floats). */
#define FW_ACC32                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "  \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define FW_D32                                                                                     \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),            \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),    \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), \
        "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
/* One product, TY the 16-bit type's name: A in registers a (rs) or at descriptor a (ss). */
#define FW_MMA_RS(TY)                                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %38, 0;\n"                                      \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FW_ACC32              \
                 "{%32, %33, %34, %35}, %36, p, 1, 1, %37;\n}\n"                                   \
                 : FW_D32                                                                          \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TB), "r"(1))
#define FW_MMA_SS(TY)                                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %35, 0;\n"                                      \
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY "." TY " " FW_ACC32              \
                 "%32, %33, p, 1, 1, 0, %34;\n}\n"                                                 \
                 : FW_D32                                                                          \
                 : "l"(a), "l"(b), "n"(TB), "r"(1))

template <class T16, int TB>
static __device__ __forceinline__ void fw_mma(float (&d)[32], const unsigned (&a)[4], uint64_t b)
{
    if constexpr (std::is_same<T16, __half>::value)
        FW_MMA_RS("f16");
    else
        FW_MMA_RS("bf16");
}

/* The same with A (64 x 16) from a K-major swizzled tile too: descriptor a. */
template <class T16, int TB>
static __device__ __forceinline__ void fw_mma_s(float (&d)[32], uint64_t a, uint64_t b)
{
    if constexpr (std::is_same<T16, __half>::value)
        FW_MMA_SS("f16");
    else
        FW_MMA_SS("bf16");
}

/* Before a group of products: their accumulators' and operands' registers are written.
 * The compiler does not see that the products read those registers after the fence, so
 * the caller first passes each through fw_keep / fw_keep_a (volatile, in order with the
 * fence), or the writes could be scheduled after it and the products read stale values. */
static __device__ __forceinline__ void fw_fence(void)
{
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

/* Ends a group of products (issued since the last commit), not waiting for it. */
static __device__ __forceinline__ void fw_commit(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

/* Waits until at most N committed groups of products are pending (the oldest first). */
template <int N> static __device__ __forceinline__ void fw_wait(void)
{
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Ends a group of products and waits for it (and any before it). */
static __device__ __forceinline__ void fw_commit_wait(void)
{
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

/* Registers a group reads or writes: not to be moved across the fence before it or the
 * wait after it. */
template <int N> static __device__ __forceinline__ void fw_keep(float (&d)[N])
{
#pragma unroll
    for (int i = 0; i < N; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
static __device__ __forceinline__ void fw_keep_a(unsigned (&a)[4][4])
{
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+r"(a[i][j])::"memory");
}

/* Shared memory written by cp.async (the generic proxy), then read by wgmma (the async
 * proxy): each writing thread fences after its copies land, before the barrier. */
static __device__ __forceinline__ void fw_proxy_fence(void)
{
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* A thread's 32 accumulators as 16-bit pairs: P (or dS) as the 4 A operands of its
 * 16-column slices (the layouts of fm_pv_mt). */
template <class T16>
static __device__ __forceinline__ void fw_pack_a(unsigned (&a)[4][4], const float (&x)[32])
{
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            a[kk][i] = fm_pack<T16>(x[8 * kk + 2 * i], x[8 * kk + 2 * i + 1]);
}

/* d += A B over k = 64: A's 4 slices in registers, B the MN-major tile at shared address
 * b (4 products, issued; the caller fences before and waits after). */
template <class T16>
static __device__ __forceinline__ void fw_products_rs(float (&d)[32], const unsigned (&a)[4][4],
                                                      unsigned b)
{
    const uint64_t db = fw_desc(b); /* + 2048 kk bytes: + 128 kk in the 16-byte field */
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        fw_mma<T16, 1>(d, a[kk], db + 128 * kk);
}

/* d += A B^T over k = 64: A and B the K-major tiles at shared addresses a and b (4
 * products, issued; the caller fences before and waits after). */
template <class T16>
static __device__ __forceinline__ void fw_products_ss(float (&d)[32], unsigned a, unsigned b)
{
    const uint64_t da = fw_desc(a), db = fw_desc(b); /* + 32 kk bytes: + 2 kk */
#pragma unroll
    for (int kk = 0; kk < 4; kk++)
        fw_mma_s<T16, 0>(d, da + 2 * kk, db + 2 * kk);
}

/* s = A1 B1^T and t = A2 B2^T over k = 64, the four 64 x 64 tiles K-major in shared
 * memory (a1, b1, a2, b2); one group, fenced and waited for. */
template <class T16>
static __device__ __forceinline__ void fw_scores2(float (&s)[32], unsigned a1, unsigned b1,
                                                  float (&t)[32], unsigned a2, unsigned b2)
{
#pragma unroll
    for (int i = 0; i < 32; i++)
        s[i] = t[i] = 0.f;
    fw_keep(s);
    fw_keep(t);
    fw_fence();
    fw_products_ss<T16>(s, a1, b1);
    fw_products_ss<T16>(t, a2, b2);
    fw_commit_wait();
    fw_keep(s);
    fw_keep(t);
}
