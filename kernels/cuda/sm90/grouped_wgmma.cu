/* kernels/cuda/sm90/grouped_wgmma.cu: the experts' grouped GEMMs on Hopper's warpgroup
 * MMA (wgmma, sm_90a) in bf16 / fp16: every problem of a call (grouped_wgmma.h) in one
 * persistent launch, so that no expert's last wave leaves SMs idle and no call waits for
 * another's. matmul.cu takes it on compute capability 9.0 unless MOE_GROUPED_GEMM=cublas.
 *
 * A block of three warpgroups computes 128 x 256 tiles of C. The first warpgroup's thread
 * 0 copies each 64-wide slice of k of A (128 x 64) and B (64 x 256) into one of 4 buffers
 * by the tensor memory accelerator (TMA: cp.async.bulk.tensor, a tensor map a problem and
 * operand, encoded here on the host, 128-byte swizzled as wgmma reads it); the tensor
 * maps bound each operand to its problem, so the TMA fills rows and columns past m, n and
 * k with zeros and a slice never reads another problem's rows. The other two warpgroups
 * own 64 rows each: per slice, 4 wgmma m64n256k16 with both operands in shared memory
 * (sm90/wgmma.cuh). Each buffer has two mbarriers: "full" (the copies' bytes landed) and
 * "empty" (the 8 computing warps are done with it). The copies run up to 4 slices ahead
 * of the products, across the tiles' ends. Sums in a fixed order: deterministic. */
#include <stdint.h>

#include <cuda.h>

#include "kernels/cuda/cuda_common.cuh"

#include "kernels/cuda/attention_mma.cuh"
#include "kernels/cuda/sm90/grouped_wgmma.h"
#include "kernels/cuda/swiglu.cuh"
#include "kernels/cuda/sm90/wgmma.cuh"

#define GW_BM 128                      /* a tile's rows: two warpgroups of 64 */
#define GW_BN 256                      /* its columns */
#define GW_BK 64                       /* k a slice */
#define GW_A_BYTES (GW_BM * GW_BK * 2) /* 16 KB a slice: two 64 x 64 tiles */
#define GW_B_BYTES (GW_BN * GW_BK * 2) /* 32 KB: four */
#define GT_STAGE_BYTES (GW_A_BYTES + GW_B_BYTES)
/* 4 buffers of slices; with TS (a tile's 16-bit outputs staged in shared memory, half a
 * warpgroup's 64 x 256 at a time, 16 KB, and stored by TMA) the staging; then the barriers
 * and the tile slots: 230528 bytes of the 232448 a block may have */
#define GT_STAGES 4
#define GT_STAGING(TS) ((TS) ? 32768 : 0)
#define GT_SMEM(TS) (GT_STAGES * GT_STAGE_BYTES + GT_STAGING(TS) + 1024 + 128)
#define GT_TMA_STORE 4 /* a problem's flag beside GW_OUT16: its map tc is encoded */

/* A slice's descriptor: the 128-byte swizzle, 8-row groups 1024 bytes apart (SBO), lbo
 * the distance of 64-wide atoms along M or N in an MN-major operand (unused K-major). */
static __device__ __forceinline__ uint64_t gw_desc(unsigned a, unsigned lbo)
{
    return (uint64_t)((a & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* d (64 x 256 fp32, this thread's 128) = or += A (64 x 16) B (16 x 256), both at
 * descriptors; TA / TB: A M-major / B N-major; acc 0 overwrites d. */
#define GW_D16(i)                                                                                  \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]),    \
        "+f"(d[i + 6]), "+f"(d[i + 7]), "+f"(d[i + 8]), "+f"(d[i + 9]), "+f"(d[i + 10]),           \
        "+f"(d[i + 11]), "+f"(d[i + 12]), "+f"(d[i + 13]), "+f"(d[i + 14]), "+f"(d[i + 15])
/* clang-format off */
#define GW_ACC128 \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, " \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, " \
    "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
    "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, " \
    "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, " \
    "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, " \
    "%120, %121, %122, %123, %124, %125, %126, %127}, "
/* clang-format on */
#define GW_MMA(TY)                                                                                 \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                     \
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " " GW_ACC128            \
                 "%128, %129, p, 1, 1, %131, %132;\n}\n"                                           \
                 : GW_D16(0), GW_D16(16), GW_D16(32), GW_D16(48), GW_D16(64), GW_D16(80),          \
                   GW_D16(96), GW_D16(112)                                                         \
                 : "l"(a), "l"(b), "r"(acc), "n"(TA), "n"(TB))

template <class T16, int TA, int TB>
static __device__ __forceinline__ void gw_mma(float (&d)[128], uint64_t a, uint64_t b, int acc)
{
    if constexpr (std::is_same<T16, __half>::value)
        GW_MMA("f16");
    else
        GW_MMA("bf16");
}

/* This thread's 128 values of a warpgroup's 64 x 256 part of a tile, rows from wm0 and
 * columns from n0 of C (m x n, row stride ldc, flags GW_OUT16 / GW_ACC): d[4 j + e] is row
 * 16 w + l / 4 + 8 (e / 2), column 8 j + 2 (l % 4) + e % 2 (warp w of the warpgroup, lane
 * l); rows past m and columns past n are not written. */
template <class T16>
static __device__ __forceinline__ void gw_store(void *c, int m, int n, int ldc, int flags,
                                                const float (&d)[128], int wm0, int n0)
{
    const int w = (threadIdx.x >> 5) & 3, l = threadIdx.x & 31;
    const int row0 = wm0 + 16 * w + (l >> 2);
    const int out16 = flags & GW_OUT16, acc = flags & GW_ACC;
    const int bf16 = !std::is_same<T16, __half>::value;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int row = row0 + 8 * h;
        if (row >= m)
            continue;
        const size_t base = (size_t)row * ldc;
#pragma unroll
        for (int j = 0; j < 32; j++) {
            const int col = n0 + 8 * j + 2 * (l & 3);
            if (col >= n)
                continue;
            float x = d[4 * j + 2 * h], y = d[4 * j + 2 * h + 1];
            if (out16) {
                unsigned *q = (unsigned *)((T16 *)c + base + col);
                if (acc) {
                    const unsigned old = *q;
                    x += moe_widen16((uint16_t)(old & 0xFFFFu), bf16);
                    y += moe_widen16((uint16_t)(old >> 16), bf16);
                }
                *q = fm_pack<T16>(x, y);
            } else {
                float2 *q = (float2 *)((float *)c + base + col);
                if (acc) {
                    const float2 old = *q;
                    x += old.x;
                    y += old.y;
                }
                *q = make_float2(x, y);
            }
        }
    }
}

typedef struct {
    void *c;
    int m, n, k, k2, ldc, tile0, tiles_n, flags; /* k2: the second product's k (or 0) */
} gt_problem;

/* 3 x 64 maps of 128 bytes and 64 x 44 bytes of problems: 27 KB of parameters */
typedef struct {
    CUtensorMap ta[GW_MAX], tb[GW_MAX]; /* A's and B's maps */
    CUtensorMap tc[GW_MAX];             /* C's, where flags has GT_TMA_STORE */
    gt_problem p[GW_MAX];
    int count, total;
    int *next; /* the tiles handed out past the first gridDim.x (zeroed before the launch) */
} gt_args;

static __device__ __forceinline__ void gt_bar_init(unsigned bar, unsigned count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void gt_bar_expect(unsigned bar, unsigned bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void gt_bar_arrive(unsigned bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

/* Waits until the barrier's phase of the given parity has completed. */
static __device__ __forceinline__ void gt_bar_wait(unsigned bar, unsigned parity)
{
    asm volatile("{\n.reg .pred done;\n"
                 "WAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}

/* The box at (c0 inner, c1) of the map into shared memory dst, counted on bar. */
static __device__ __forceinline__ void gt_load(unsigned dst, const CUtensorMap *map, int c0, int c1,
                                               unsigned bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
}

/* Where tile t of the launch lies: its problem (from *pi on: a block's tiles only grow),
 * m0, n0 and the slices of k: nk1 of the first product's, nk in all (a problem with k2
 * walks the second product's slices after the first's, from the maps at pi + GW_SW). */
template <int SW>
static __device__ __forceinline__ void gt_locate(const gt_args &g, int t, int *pi, int *m0, int *n0,
                                                 int *nk1, int *nk)
{
    while (*pi + 1 < g.count && g.p[*pi + 1].tile0 <= t)
        ++*pi;
    const gt_problem &p = g.p[*pi];
    const int local = t - p.tile0;
    *m0 = (local / p.tiles_n) * GW_BM;
    *n0 = (local % p.tiles_n) * (SW ? GW_BN / 2 : GW_BN);
    *nk1 = (p.k + GW_BK - 1) / GW_BK;
    *nk = *nk1 + (p.k2 + GW_BK - 1) / GW_BK;
}

/* Tiles are handed out as blocks ask (an atomic counter after each block's first), so that
 * a block that started late, its SM held by another stream's work, takes fewer. The
 * producer writes each slice's tile into its buffer's slot before the copies; a slot of -1
 * (its full barrier completed without bytes) ends the computing warpgroups' walk. */
template <class T16, int AMN, int BNM, int TS, int SW>
__global__ void __launch_bounds__(384, 1) gt_kernel(const __grid_constant__ gt_args g)
{
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    return; /* never: CMakeLists.txt builds this file for sm_90a alone */
#else
    constexpr int NS = GT_STAGES; /* buffers */
    extern __shared__ unsigned char gw_smem[];
    const unsigned base = fw_align1024(gw_smem);
    const unsigned staging = base + NS * GT_STAGE_BYTES; /* 16 KB a warpgroup (TS) */
    const unsigned bars = staging + GT_STAGING(TS);      /* full[s], then empty[s] */
    volatile int *slot =
        (volatile int *)(gw_smem + (bars - (unsigned)__cvta_generic_to_shared(gw_smem)) + 16 * NS);
    if (threadIdx.x == 0) {
        for (int s = 0; s < NS; s++) {
            gt_bar_init(bars + 8 * s, 1);
            gt_bar_init(bars + 8 * (NS + s), 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x < 128) { /* the producer: one thread */
        if (threadIdx.x != 0)
            return;
        int s = 0, ph = 0, pi = 0;
        for (int t = blockIdx.x;; t = gridDim.x + atomicAdd(g.next, 1)) {
            if (t >= g.total) { /* the end: a slot of -1, its barrier completed */
                gt_bar_wait(bars + 8 * (NS + s), ph ^ 1);
                slot[s] = -1;
                gt_bar_arrive(bars + 8 * s);
                return;
            }
            int m0, n0, nk1, nk;
            gt_locate<SW>(g, t, &pi, &m0, &n0, &nk1, &nk);
            for (int kt = 0; kt < nk; kt++) {
                const unsigned full = bars + 8 * s, sa = base + (unsigned)s * GT_STAGE_BYTES,
                               sb = sa + GW_A_BYTES;
                gt_bar_wait(bars + 8 * (NS + s), ph ^ 1);
                slot[s] = t;
                gt_bar_expect(full, GT_STAGE_BYTES);
                const int second = !SW && kt >= nk1; /* the second product's slices */
                const CUtensorMap *ta = &g.ta[pi + (second ? GW_SW : 0)],
                                  *tb = &g.tb[pi + (second ? GW_SW : 0)];
                const int k0 = (second ? kt - nk1 : kt) * GW_BK;
                if (!AMN) {
                    gt_load(sa, ta, k0, m0, full);
                } else {
                    gt_load(sa, ta, m0, k0, full);
                    gt_load(sa + 8192u, ta, m0 + 64, k0, full);
                }
                if (SW) { /* the gate's 128 rows of B, then the up projection's */
                    gt_load(sb, tb, k0, n0, full);
                    gt_load(sb + GW_B_BYTES / 2, &g.tb[pi + GW_SW], k0, n0, full);
                } else if (!BNM) {
                    gt_load(sb, tb, k0, n0, full);
                } else {
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        gt_load(sb + 8192u * j, tb, n0 + 64 * j, k0, full);
                }
                if (++s == NS)
                    s = 0, ph ^= 1;
            }
        }
    }
    /* the two computing warpgroups */
    const int cw = (threadIdx.x >> 7) - 1, lane = threadIdx.x & 31;
    float d[128];
#pragma unroll
    for (int i = 0; i < 128; i++)
        d[i] = 0.f;
    int s = 0, ph = 0, prev = -1, pi = 0;
    for (;;) {
        gt_bar_wait(bars + 8 * s, ph);
        const int t = slot[s];
        if (t < 0)
            break;
        int m0, n0, nk1, nk;
        gt_locate<SW>(g, t, &pi, &m0, &n0, &nk1, &nk);
        const gt_problem &p = g.p[pi];
        /* this warpgroup's 64 rows lie past the problem's: no stores. Its products still
         * run: a branch around wgmma makes ptxas serialize every wgmma of the kernel
         * (C7520, which scripts/wgmma-guard.sh turns into a failed build) */
        const int live = m0 + 64 * cw < p.m;
        for (int kt = 0; kt < nk; kt++) {
            if (kt > 0)
                gt_bar_wait(bars + 8 * s, ph);
            const unsigned sa = base + (unsigned)s * GT_STAGE_BYTES + (unsigned)cw * 8192u,
                           sb = base + (unsigned)s * GT_STAGE_BYTES + GW_A_BYTES;
            fw_keep(d);
            fw_fence();
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                const uint64_t da = AMN ? gw_desc(sa + 2048u * kk, 16) : gw_desc(sa + 32u * kk, 16);
                const uint64_t db =
                    BNM ? gw_desc(sb + 2048u * kk, 8192) : gw_desc(sb + 32u * kk, 16);
                gw_mma<T16, AMN, BNM>(d, da, db, kt > 0 || kk > 0);
            }
            fw_commit();
            fw_wait<1>(); /* the products of the slice before are done: its buffer is free */
            if (prev >= 0 && lane == 0)
                gt_bar_arrive(bars + 8 * (NS + prev));
            prev = s;
            if (++s == NS)
                s = 0, ph ^= 1;
        }
        fw_wait<0>();
        fw_keep(d);
        if (prev >= 0 && lane == 0)
            gt_bar_arrive(bars + 8 * (NS + prev));
        prev = -1;
        if (!live)
            continue;
        if (SW || (TS && p.flags == (GW_OUT16 | GT_TMA_STORE))) {
            /* staged in this warpgroup's 16 KB, 128 columns at a time, as two of the map's
             * 64 x 64 boxes (128-byte swizzle), then stored by TMA, which writes nothing
             * past m and n; the last half is not waited for, so the next tile's products
             * start at once. SW: the halves are the gate's 128 columns, the up
             * projection's, and a third, h of both (each from its rounded 16-bit values,
             * as swiglu.cu's kernels read them: the same bits), each to its own map */
            const unsigned stg = staging + (unsigned)cw * 16384u;
            const int wt = threadIdx.x & 127, w = wt >> 5;
            constexpr int bf16 = !std::is_same<T16, __half>::value;
#pragma unroll
            for (int half = 0; half < (SW ? 3 : 2); half++) {
                if (wt == 0) /* the last store from this staging has read it */
                    asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
                asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int r = 16 * w + (lane >> 2) + 8 * h; /* 0 .. 63 */
#pragma unroll
                    for (int jj = 0; jj < 16; jj++) { /* box jj / 8, 16-byte chunk jj % 8 */
                        const int j = 16 * half + jj;
                        const unsigned at = stg + (unsigned)(jj >> 3) * 8192u + (unsigned)r * 128u +
                                            (unsigned)(((jj & 7) ^ (r & 7)) << 4) +
                                            4u * (unsigned)(lane & 3);
                        unsigned v;
                        if (SW && half == 2) {
                            float e2[2];
#pragma unroll
                            for (int e = 0; e < 2; e++)
                                e2[e] = swiglu_h<float>(
                                    moe_widen16(moe_round16(d[4 * jj + 2 * h + e], bf16), bf16),
                                    moe_widen16(moe_round16(d[4 * (16 + jj) + 2 * h + e], bf16),
                                                bf16));
                            v = (unsigned)moe_round16(e2[0], bf16) |
                                (unsigned)moe_round16(e2[1], bf16) << 16;
                        } else {
                            v = fm_pack<T16>(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
                        }
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(at), "r"(v) : "memory");
                    }
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
                if (wt == 0) {
                    const CUtensorMap *map = !SW         ? &g.tc[pi]
                                             : half == 0 ? &g.tc[pi]
                                             : half == 1 ? &g.tc[pi + GW_SW]
                                                         : &g.ta[pi + GW_SW];
                    const int c0 = SW ? n0 : n0 + 128 * half;
                    for (int b = 0; b < 2 && c0 + 64 * b < p.n; b++)
                        asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group "
                                     "[%0, {%1, %2}], [%3];\n" ::"l"((unsigned long long)map),
                                     "r"(c0 + 64 * b), "r"(m0 + 64 * cw), "r"(stg + 8192u * b)
                                     : "memory");
                    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
                }
            }
        } else {
            gw_store<T16>(p.c, p.m, p.n, p.ldc, p.flags & (GW_OUT16 | GW_ACC), d, m0 + 64 * cw, n0);
        }
    }
    if (TS && (threadIdx.x & 127) == 0) /* the stores have ended before the block does */
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

typedef CUresult (*gt_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                 const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                 const cuuint32_t *, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

/* The driver's cuTensorMapEncodeTiled, through the runtime (no link to libcuda). */
static gt_encode_fn gt_encoder(void)
{
    static gt_encode_fn fn;
    static int tried;
    if (!tried) {
        tried = 1;
        void *f = NULL;
        cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
        if (MOE_CUDA_OK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                         cudaEnableDefault, &q)) &&
            q == cudaDriverEntryPointSuccess)
            fn = (gt_encode_fn)f;
    }
    return fn;
}

/* The map of a rows x cols 16-bit matrix at ptr (row stride ld values) in boxes of 64
 * columns by box_rows rows, 128-byte swizzled as wgmma reads them; 0 on failure. */
static int gt_map(gt_encode_fn fn, CUtensorMap *map, int bf16, const void *ptr, int rows, int cols,
                  int ld, int box_rows)
{
    const cuuint64_t dim[2] = {(cuuint64_t)cols, (cuuint64_t)rows};
    const cuuint64_t stride[1] = {(cuuint64_t)ld * 2};
    const cuuint32_t box[2] = {64, (cuuint32_t)box_rows}, es[2] = {1, 1};
    return fn(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
              (void *)ptr, dim, stride, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* The maps of A (a) and B (b) of problem q's shape with k for its k, by the layouts amn
 * and bnm; 0 on failure. */
static int gt_maps_ab(gt_encode_fn fn, CUtensorMap *ta, CUtensorMap *tb, int bf16, int amn, int bnm,
                      const void *a, const void *b, const gw_problem *q, int k)
{
    return (amn ? gt_map(fn, ta, bf16, a, k, q->m, q->lda, 64)
                : gt_map(fn, ta, bf16, a, q->m, k, q->lda, GW_BM)) &&
           (bnm ? gt_map(fn, tb, bf16, b, k, q->n, q->ldb, 64)
                : gt_map(fn, tb, bf16, b, q->n, k, q->ldb, GW_BN));
}

/* Problem q as the kernel reads it (k2, flags), its tiles bn columns wide numbered from
 * *total on (which grows by their count). */
static void gt_problem_from(gt_problem *p, const gw_problem *q, int k2, int flags, int bn,
                            int *total)
{
    p->c = q->c;
    p->m = q->m;
    p->n = q->n;
    p->k = q->k;
    p->k2 = k2;
    p->ldc = q->ldc;
    p->flags = flags;
    p->tiles_n = (p->n + bn - 1) / bn;
    p->tile0 = *total;
    *total += (p->m + GW_BM - 1) / GW_BM * p->tiles_n;
}

#define GT_PICK(TS)                                                                                \
    (v == 0   ? (bf16 ? gt_kernel<__nv_bfloat16, 0, 0, TS, 0> : gt_kernel<__half, 0, 0, TS, 0>)    \
     : v == 1 ? (bf16 ? gt_kernel<__nv_bfloat16, 0, 1, TS, 0> : gt_kernel<__half, 0, 1, TS, 0>)    \
              : (bf16 ? gt_kernel<__nv_bfloat16, 1, 1, TS, 0> : gt_kernel<__half, 1, 1, TS, 0>))

static int *gt_counters, gt_turn; /* 64 tile counters, taken in turn: a flush joins its lanes,
                                   * so a counter's last launch has ended when it comes again */

/* The next tile counter, zeroed on stream s (NULL on failure). */
static int *gt_counter(cudaStream_t s)
{
    if (!gt_counters && !MOE_CUDA_OK(cudaMalloc((void **)&gt_counters, 64 * sizeof(int))))
        return NULL;
    int *c = gt_counters + gt_turn;
    gt_turn = (gt_turn + 1) % 64;
    return MOE_CUDA_OK(cudaMemsetAsync(c, 0, sizeof(int), s)) ? c : NULL;
}

/* g's problems (at most GW_MAX) in one launch on stream s: bf16 or fp16 operands, amn /
 * bnm the layouts of A and B (grouped_wgmma.h; amn without bnm is not built), sms the SMs
 * (a block each). 0 when it cannot run (recorded where a CUDA call failed); every map is
 * encoded before the launch, so that then nothing is queued. Called by matmul.cu on
 * compute capability 9.0 only. */
extern "C" int cuda_wgmma_grouped(int bf16, int amn, int bnm, const gw_args *g, int sms,
                                  cudaStream_t s)
{
    static gt_args a;
    static int ready[2][3][2];
    bf16 = bf16 != 0;
    const gt_encode_fn fn = gt_encoder();
    int second = 0; /* problems with a second product: their maps at i + GW_SW */
    for (int i = 0; i < g->count; i++)
        second |= g->p[i].k2 > 0;
    if ((amn && !bnm) || !fn || g->count > (second ? GW_SW : GW_MAX))
        return 0;
    const int v = amn + bnm;
    /* the tiles of 16-bit outputs (not added to) are stored by TMA from shared memory;
     * MOE_GROUPED_WGMMA_TMASTORE=0 (a benchmark's knob) stores them from registers */
    const int want_ts = !moe_cuda_env_is("MOE_GROUPED_WGMMA_TMASTORE", "0");
    int ts = 0;
    /* the problems by k, the longest first (stable), so that the tiles handed out last
     * are the shortest: the weight gradients' k is the expert's rows */
    int order[GW_MAX];
    for (int i = 0; i < g->count; i++) {
        int j = i;
        for (; j > 0 && g->p[order[j - 1]].k + g->p[order[j - 1]].k2 < g->p[i].k + g->p[i].k2; j--)
            order[j] = order[j - 1];
        order[j] = i;
    }
    a.count = g->count;
    a.total = 0;
    for (int i = 0; i < a.count; i++) {
        const gw_problem *q = &g->p[order[i]];
        const int k2 = q->k2 > 0 ? q->k2 : 0;
        if (!gt_maps_ab(fn, &a.ta[i], &a.tb[i], bf16, amn, bnm, q->a, q->b, q, q->k) ||
            (k2 && !gt_maps_ab(fn, &a.ta[i + GW_SW], &a.tb[i + GW_SW], bf16, amn, bnm, q->a2, q->b2,
                               q, k2)))
            return 0;
        int flags = q->flags;
        /* C's map where its tiles go by TMA (else, as for an unaligned C, from registers) */
        if (want_ts && q->flags == GW_OUT16 &&
            gt_map(fn, &a.tc[i], bf16, q->c, q->m, q->n, q->ldc, 64)) {
            flags |= GT_TMA_STORE;
            ts = 1; /* the kernel with the staging */
        }
        gt_problem_from(&a.p[i], q, k2, flags, GW_BN, &a.total);
    }
    if (a.total <= 0)
        return 1;
    void (*k)(gt_args) = ts ? GT_PICK(1) : GT_PICK(0);
    const int smem = ts ? GT_SMEM(1) : GT_SMEM(0);
    if (!ready[bf16][v][ts]) {
        if (!MOE_CUDA_OK(
                cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem)))
            return 0;
        ready[bf16][v][ts] = 1;
    }
    if (!(a.next = gt_counter(s)))
        return 0;
    const int grid = a.total < sms ? a.total : sms;
    k<<<grid, 384, smem, s>>>(a);
    return MOE_CUDA_OK(cudaGetLastError());
}

/* The experts' gate and up projections with SwiGLU in the epilogue, in one launch on
 * stream s: problem i of g (at most GW_SW, the forward's layout: A and B K-major, 16-bit
 * C) is the gate's, C = x_i wa_i^T; up_w[i] is the up projection's B (as problem i's),
 * up[i] its C and h[i] SwiGLU's of both (each as problem i's C: 16-bit, ldc apart). A
 * tile is 128 columns of both (B's buffer holds wa's 128 rows, then wb's). 0 where it
 * cannot run (recorded where a CUDA call failed); every map is encoded before the launch,
 * so that then nothing is queued. Called by matmul.cu on compute capability 9.0 only. */
extern "C" int cuda_wgmma_grouped_swiglu(int bf16, const gw_args *g, const uint16_t *const *up_w,
                                         void *const *up, void *const *h, int sms, cudaStream_t s)
{
    static gt_args a;
    static int ready[2];
    bf16 = bf16 != 0;
    const gt_encode_fn fn = gt_encoder();
    if (!fn || g->count > GW_SW)
        return 0;
    a.count = g->count;
    a.total = 0;
    for (int i = 0; i < a.count; i++) {
        const gw_problem *q = &g->p[i];
        if (q->flags != GW_OUT16 || !gt_map(fn, &a.ta[i], bf16, q->a, q->m, q->k, q->lda, GW_BM) ||
            !gt_map(fn, &a.tb[i], bf16, q->b, q->n, q->k, q->ldb, GW_BN / 2) ||
            !gt_map(fn, &a.tb[i + GW_SW], bf16, up_w[i], q->n, q->k, q->ldb, GW_BN / 2) ||
            !gt_map(fn, &a.tc[i], bf16, q->c, q->m, q->n, q->ldc, 64) ||
            !gt_map(fn, &a.tc[i + GW_SW], bf16, up[i], q->m, q->n, q->ldc, 64) ||
            !gt_map(fn, &a.ta[i + GW_SW], bf16, h[i], q->m, q->n, q->ldc, 64))
            return 0;
        gt_problem_from(&a.p[i], q, 0, GW_OUT16 | GT_TMA_STORE, GW_BN / 2, &a.total);
    }
    if (a.total <= 0)
        return 1;
    void (*k)(gt_args) =
        bf16 ? gt_kernel<__nv_bfloat16, 0, 0, 1, 1> : gt_kernel<__half, 0, 0, 1, 1>;
    if (!ready[bf16]) {
        if (!MOE_CUDA_OK(
                cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, GT_SMEM(1))))
            return 0;
        ready[bf16] = 1;
    }
    if (!(a.next = gt_counter(s)))
        return 0;
    const int grid = a.total < sms ? a.total : sms;
    k<<<grid, 384, GT_SMEM(1), s>>>(a);
    return MOE_CUDA_OK(cudaGetLastError());
}
