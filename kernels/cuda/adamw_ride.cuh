/* kernels/cuda/adamw_ride.cuh: what AdamW's kernels (optim.cu) share with the warps that
 * take the update's chunks inside the experts' grouped GEMM (sm90/grouped_wgmma.cu): the
 * 16-bit loads and stores, the moments' and master weights' roundings, the segment walk,
 * and the ride (MOE_ADAMW_RIDE=1, a trial; docs/cuda.md, AdamW riding the GEMMs).
 *
 * A ride is one piece of the update (runtime/trainer.c update_piece) over bf16 master
 * weights with bf16 moments and bf16 gradients (the experts' part at the bench shape), cut
 * into chunks of ADAMW_RIDE_CHUNK elements. Any warp may take the next chunk from the
 * ride's counter: the three idle warps of each grouped GEMM block on the queue, while the
 * block's products run (an AdamW block cannot share an SM with that kernel: its 384
 * threads take every register), and the update's own kernel on the background queue,
 * which guarantees that every chunk is taken. A chunk is stepped by one warp, its lanes
 * over the same groups of 8 whoever takes it, so each element gets the bits the
 * whole-arena pass gives it (the same moe_adamw_elem, the same roundings and random
 * bits), and the chunk's sum of squares (in double, lanes then the warp in a fixed
 * order) is the same wherever it ran; adamw_square_final adds the chunks' sums in chunk
 * order. */
#ifndef MOE_KERNELS_CUDA_ADAMW_RIDE_CUH
#define MOE_KERNELS_CUDA_ADAMW_RIDE_CUH

#include "kernels/cuda/cuda_common.cuh"

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

/* W moments rounded to bf16 (bf16x2_round) into b's words. */
template <int W> static __device__ __forceinline__ void round_moments(bits16<W> &b, const float *x)
{
#pragma unroll
    for (int e = 0; e < W; e += 2)
        b.w[e / 2] = bf16x2_round(x[e], x[e + 1]);
}

/* W (a multiple of 4) master weights from element i0 (a multiple of 4) rounded
 * stochastically into b's words, group of 4 i0 / 4 + q with the bits of sr_bits(i0 / 4 +
 * q, seed), element 4 q + e with its 16 bits from 16 e. */
template <int W>
static __device__ __forceinline__ void round_weights(bits16<W> &b, const float *p, size_t i0,
                                                     uint32_t seed)
{
#pragma unroll
    for (int q = 0; q < W / 4; q++) {
        const uint64_t r = sr_bits(i0 / 4 + q, seed);
        b.w[2 * q] = bf16_round_stochastic(p[4 * q], (uint32_t)r) |
                     (uint32_t)bf16_round_stochastic(p[4 * q + 1], (uint32_t)(r >> 16)) << 16;
        b.w[2 * q + 1] = bf16_round_stochastic(p[4 * q + 2], (uint32_t)(r >> 32)) |
                         (uint32_t)bf16_round_stochastic(p[4 * q + 3], (uint32_t)(r >> 48)) << 16;
    }
}

static __device__ __forceinline__ bits16<8> bits_of(uint4 q)
{
    return bits16<8>{{q.x, q.y, q.z, q.w}};
}
static __device__ __forceinline__ uint4 uint4_of(const bits16<8> &b)
{
    return make_uint4(b.w[0], b.w[1], b.w[2], b.w[3]);
}

/* groups of 8 elements a lane steps in a chunk, 4 at a time (16 loads of 16 bytes in
 * flight); a chunk is 32 lanes of them: 4096 elements, 57 KB moved */
#define ADAMW_RIDE_GROUPS 16
#define ADAMW_RIDE_CHUNK (32 * ADAMW_RIDE_GROUPS * 8)
#define ADAMW_RIDE_MAX 16 /* rides queued at once (a step's expert pieces, the first taken) */

/* One ride: elements [lo, lo + n) of the arena (lo and n multiples of 8, all from the
 * master weights' start and from the squares' split on: optim.cu checks), every array at
 * element lo. */
typedef struct {
    uint16_t *w;           /* the bf16 master weights (the shadow) */
    const uint16_t *g;     /* their bf16 gradients */
    uint16_t *m, *v;       /* the bf16 moments */
    const int64_t *seg_lo; /* the arena's segments (n_segs offsets) and their decays */
    const real *wd;
    int n_segs;
    int chunks; /* ceil(n / ADAMW_RIDE_CHUNK) */
    size_t lo, n;
    moe_adamw_consts ac;
    real scale;    /* the gradients' factor: 1 / loss scale, rounded to float */
    uint32_t seed; /* the step (the stochastic rounding's bits) */
    int *next;     /* chunks taken (zeroed before the ride is queued) */
    int *taken;    /* [0] chunks taken inside the GEMM, [1] by the update's kernel */
    double2 *part; /* chunk c's sum of squares at part[c].y (.x 0: below the split) */
} adamw_ride;

typedef struct {
    int count;
    int warps; /* of a grouped GEMM block's 3 idle warps, how many ride (MOE_ADAMW_RIDE_WARPS) */
    adamw_ride r[ADAMW_RIDE_MAX];
} adamw_rides;

/* optim.cu's side, for the grouped GEMM (sm90/grouped_wgmma.cu) and the backend:
 * the rides queued since the last join (NULL: none); the chunks queued as rides so far and
 * how many warps inside the grouped GEMMs and the update's own kernel took (waits for the
 * device; 0 on failure); and the join's part (their sums of squares added up on the queue,
 * their counters zeroed), which background_join calls after the queue's wait for the
 * background. */
extern "C" const adamw_rides *cuda_adamw_rides(void);
extern "C" int cuda_adamw_ride_counts(long *queued, long *inside, long *own);
extern "C" void cuda_adamw_rides_join(void);

/* Chunk c of ride r by the calling warp (lane its lane): each lane's groups
 * c * 512 + 128 i + 32 j + lane (i < 4, j < 4) of the ride, their loads issued 4 groups
 * at a time; streaming loads and stores (evict first), so the update's bytes pass the L2
 * without pushing out the GEMM's operands. */
static __device__ __forceinline__ void adamw_ride_chunk(const adamw_ride &r, int c, int lane)
{
    const size_t groups = r.n / 8, g0 = (size_t)c * (ADAMW_RIDE_CHUNK / 8);
    double sq = 0.0;
    int seg = -1;
#pragma unroll 1
    for (int i = 0; i < ADAMW_RIDE_GROUPS / 4; i++) {
        uint4 wq[4], gq[4], mq[4], vq[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const size_t q = g0 + 128 * i + 32 * j + lane;
            if (q < groups) {
                wq[j] = __ldcs((const uint4 *)r.w + q);
                gq[j] = __ldcs((const uint4 *)r.g + q);
                mq[j] = __ldcs((const uint4 *)r.m + q);
                vq[j] = __ldcs((const uint4 *)r.v + q);
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const size_t q = g0 + 128 * i + 32 * j + lane;
            if (q >= groups)
                continue;
            const size_t i0 = r.lo + 8 * q; /* the arena's element */
            float pe[8], ge[8], me[8], ve[8];
            widen_bf16<8>(pe, bits_of(wq[j]));
            widen_bf16<8>(ge, bits_of(gq[j]));
            widen_bf16<8>(me, bits_of(mq[j]));
            widen_bf16<8>(ve, bits_of(vq[j]));
#pragma unroll
            for (int e = 0; e < 8; e++)
                sq += (double)ge[e] * (double)ge[e];
            /* the group's step, as adamw_multi_kernel's (the same segment walk) */
            seg = adamw_seg(seg, i0, r.seg_lo, r.n_segs);
            const bool one_seg = seg + 1 >= r.n_segs || (int64_t)(i0 + 8) <= r.seg_lo[seg + 1];
            real decay = moe_adamw_decay(&r.ac, r.wd[seg]);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                if (!one_seg) {
                    seg = adamw_seg(seg, i0 + e, r.seg_lo, r.n_segs);
                    decay = moe_adamw_decay(&r.ac, r.wd[seg]);
                }
                pe[e] = moe_adamw_elem(pe[e], ge[e], &me[e], &ve[e], decay, r.scale, &r.ac);
            }
            bits16<8> b;
            round_moments<8>(b, me);
            __stcs((uint4 *)r.m + q, uint4_of(b));
            round_moments<8>(b, ve);
            __stcs((uint4 *)r.v + q, uint4_of(b));
            round_weights<8>(b, pe, i0, r.seed);
            __stcs((uint4 *)r.w + q, uint4_of(b));
        }
    }
    sq = moe_warp_sum_d(sq);
    if (lane == 0)
        r.part[c] = make_double2(0.0, sq);
}

/* The calling warp takes chunks of the rides in turn until they are all taken, it has
 * taken max_chunks, or *stop (shared memory; NULL: none) is set; `inside` picks the count
 * it adds to (taken[0]: a GEMM's warps, taken[1]: the update's kernel). The whole warp
 * calls it: lane 0 reads the stop and takes a chunk, the others follow. */
static __device__ __forceinline__ void adamw_ride_take(const adamw_rides &rs, volatile int *stop,
                                                       int max_chunks, int inside)
{
    const int lane = threadIdx.x & 31;
    int done = 0;
    for (int k = 0; k < rs.count; k++) {
        const adamw_ride &r = rs.r[k];
        for (;;) {
            int c = -1; /* -1: stop */
            if (lane == 0 && !(stop && *stop) && done < max_chunks)
                c = atomicAdd(r.next, 1);
            c = __shfl_sync(MOE_CUDA_FULL_MASK, c, 0);
            if (c < 0)
                return;
            if (c >= r.chunks)
                break; /* this ride is all taken: the next */
            adamw_ride_chunk(r, c, lane);
            if (lane == 0)
                atomicAdd(r.taken + (inside ? 0 : 1), 1);
            done++;
        }
    }
}

#endif
