/* kernels/cuda/bucket.cu: the two device-wide primitives the routing and scatter ops
 * share: an exclusive prefix sum of ints, and a stable grouping (counting sort) of items
 * by an int key, with an LSD radix sort built from it for keys of unknown range.
 *
 * Both are deterministic (integer atomics only: counts do not depend on their order).
 * The stable rank of an item among the items of its key within a tile is computed by
 * one warp walking the tile in order, 32 items at a time (__match_any_sync groups the
 * lanes holding the same key), so the order is exactly "by key, then by index". */
#include "kernels/cuda/cuda_common.cuh"

#define SCAN_ITEMS 4
#define SCAN_TILE (MOE_CUDA_THREADS * SCAN_ITEMS)
#define SORT_MIN_TILE 256
#define SORT_MAX_CELLS (1 << 22) /* tiles * buckets: 16 MiB of per-tile counts at most */
#define RADIX_BITS 8
#define RADIX (1 << RADIX_BITS)
#define RADIX_PASSES 4 /* 31-bit non-negative keys */

/* ---- scan ---------------------------------------------------------------------------- */

/* Exclusive scan over the WARPS * 32 threads of a block (WARPS <= 32), in thread order;
 * *total gets the block's sum. Every thread of the block must call it, and may call it
 * again: the first barrier keeps a later call's writes behind an earlier call's reads.
 * Each warp scans its values by shuffles; warp 0 then scans the warps' sums. */
template <int WARPS> static __device__ int block_scan(int v, int *total)
{
    static_assert(WARPS >= 1 && WARPS <= 32, "one warp scans the warps' sums");
    __shared__ int warp_sum[WARPS + 1]; /* [w]: the warps before w; [WARPS]: the sum */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(MOE_CUDA_FULL_MASK, x, o);
        if (lane >= o)
            x += y;
    }
    __syncthreads(); /* warp_sum may still be read by a previous call */
    if (lane == 31)
        warp_sum[warp] = x;
    __syncthreads();
    if (warp == 0) {
        const int t = lane < WARPS ? warp_sum[lane] : 0;
        int u = t;
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(MOE_CUDA_FULL_MASK, u, o);
            if (lane >= o)
                u += y;
        }
        if (lane < WARPS)
            warp_sum[lane] = u - t;
        if (lane == 31)
            warp_sum[WARPS] = u;
    }
    __syncthreads();
    *total = warp_sum[WARPS];
    return warp_sum[warp] + x - v;
}

#define SCAN_WARPS (MOE_CUDA_THREADS / 32)

static __global__ void scan_tile_sums(int *sums, const int *in, int n)
{
    const int base = blockIdx.x * SCAN_TILE + threadIdx.x * SCAN_ITEMS;
    int s = 0, total;
    for (int j = 0; j < SCAN_ITEMS; j++)
        if (base + j < n)
            s += in[base + j];
    block_scan<SCAN_WARPS>(s, &total);
    if (threadIdx.x == 0)
        sums[blockIdx.x] = total;
}

/* One block: sums[0..nb) becomes its exclusive scan, sums[nb] and *grand the total. */
static __global__ void scan_sums(int *sums, int nb, int *grand)
{
    int carry = 0, total;
    for (int c0 = 0; c0 < nb; c0 += MOE_CUDA_THREADS) {
        const int i = c0 + threadIdx.x;
        const int v = i < nb ? sums[i] : 0;
        const int p = block_scan<SCAN_WARPS>(v, &total);
        if (i < nb)
            sums[i] = carry + p;
        carry += total;
    }
    if (threadIdx.x == 0) {
        sums[nb] = carry;
        *grand = carry;
    }
}

/* sums NULL: one tile, the whole scan (out[n] = the total). */
static __global__ void scan_tiles(int *out, const int *in, int n, const int *sums)
{
    const int base = blockIdx.x * SCAN_TILE + threadIdx.x * SCAN_ITEMS;
    int v[SCAN_ITEMS], s = 0, total;
    for (int j = 0; j < SCAN_ITEMS; j++) {
        v[j] = base + j < n ? in[base + j] : 0;
        s += v[j];
    }
    int p = block_scan<SCAN_WARPS>(s, &total) + (sums ? sums[blockIdx.x] : 0);
    for (int j = 0; j < SCAN_ITEMS; j++)
        if (base + j < n) {
            out[base + j] = p;
            p += v[j];
        }
    if (!sums && threadIdx.x == 0)
        out[n] = total;
}

size_t moe_cuda_scan_ints(int n) { return (size_t)(n + SCAN_TILE - 1) / SCAN_TILE + 1; }

void moe_cuda_scan(int *out, const int *in, int n, int *scratch)
{
    if (n <= 0) {
        MOE_CUDA_OK(cudaMemsetAsync(out, 0, sizeof(int), moe_cuda_stream()));
        return;
    }
    const int nb = (n + SCAN_TILE - 1) / SCAN_TILE;
    if (nb == 1) { /* one launch */
        MOE_CUDA_LAUNCH(scan_tiles, 1, MOE_CUDA_THREADS, 0, out, in, n, (const int *)NULL);
        return;
    }
    MOE_CUDA_LAUNCH(scan_tile_sums, nb, MOE_CUDA_THREADS, 0, scratch, in, n);
    MOE_CUDA_LAUNCH(scan_sums, 1, MOE_CUDA_THREADS, 0, scratch, nb, out + n);
    MOE_CUDA_LAUNCH(scan_tiles, nb, MOE_CUDA_THREADS, 0, out, in, n, scratch);
}

/* ---- stable sort --------------------------------------------------------------------- */

/* Bucket of item i (at position i of the input order `in`, identity when NULL): its key's
 * digit at `shift` (radix pass), or the key itself when in [0, V), else -1 (left out). */
static __device__ __forceinline__ int sort_digit(int k, int shift, int V)
{
    if (shift >= 0)
        return (k >> shift) & (RADIX - 1);
    return k >= 0 && k < V ? k : -1;
}

static __device__ __forceinline__ int sort_bucket(const int32_t *keys, const int *in, int i,
                                                  int shift, int V)
{
    return sort_digit(keys[in ? in[i] : i], shift, V);
}

static __global__ void sort_count(int *cnt, const int32_t *keys, const int *in, int n, int tile,
                                  int shift, int V, int buckets)
{
    const int lo = blockIdx.x * tile, hi = min(n, lo + tile);
    int *row = cnt + (size_t)blockIdx.x * buckets;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const int b = sort_bucket(keys, in, i, shift, V);
        if (b >= 0)
            atomicAdd(&row[b], 1);
    }
}

/* Per bucket: the tiles' counts become exclusive prefixes over tiles; total = the sum. */
static __global__ void sort_columns(int *cnt, int *total, int tiles, int buckets)
{
    MOE_CUDA_GRID_STRIDE(b, buckets)
    {
        int s = 0;
        for (int t = 0; t < tiles; t++) {
            const size_t at = (size_t)t * buckets + b;
            const int c = cnt[at];
            cnt[at] = s;
            s += c;
        }
        total[b] = s;
    }
}

/* One warp ranks items [lo, hi) in order, 32 at a time: out[(start ? start[b] : 0) +
 * cursor[b] + rank] = item, cursor[b] advancing past each bucket's items (lanes of one
 * bucket ranked with __match_any_sync). The keys of RANK_AHEAD rounds are loaded before
 * the first of them is ranked: the ranking is a chain through cursor, the loads are not. */
#define RANK_AHEAD 4
static __device__ void rank_items(int *out, volatile int *cursor, const int *start,
                                  const int32_t *keys, const int *in, int lo, int hi, int shift,
                                  int V)
{
    const int lane = threadIdx.x & 31;
    for (int i0 = lo; i0 < hi; i0 += 32 * RANK_AHEAD) {
        int bs[RANK_AHEAD], items[RANK_AHEAD];
#pragma unroll
        for (int u = 0; u < RANK_AHEAD; u++) {
            const int i = i0 + u * 32 + lane;
            items[u] = i < hi && in ? in[i] : i;
            bs[u] = i < hi ? sort_digit(keys[items[u]], shift, V) : -1;
        }
#pragma unroll
        for (int u = 0; u < RANK_AHEAD; u++) {
            if (i0 + u * 32 >= hi) /* the same for the whole warp */
                break;
            const int b = bs[u];
            const unsigned peers = __match_any_sync(MOE_CUDA_FULL_MASK, b);
            const int rank = __popc(peers & ((1u << lane) - 1u));
            const int base = b >= 0 ? cursor[b] : 0;
            __syncwarp();
            if (b >= 0) {
                out[(start ? start[b] : 0) + base + rank] = items[u];
                if (rank == 0)
                    cursor[b] = base + __popc(peers);
            }
            __syncwarp();
        }
    }
}

/* One warp per tile, in item order: out[start[b] + tile base[b] + rank] = item. */
static __global__ void sort_rank(int *out, int *cnt, const int *start, const int32_t *keys,
                                 const int *in, int n, int tile, int shift, int V, int buckets)
{
    const int lo = blockIdx.x * tile, hi = min(n, lo + tile);
    rank_items(out, cnt + (size_t)blockIdx.x * buckets, start, keys, in, lo, hi, shift, V);
}

/* ---- the whole sort in one block (the default; MOE_SORT_ONE_BLOCK=0: the passes above) --
 * Above, a pass is 7 launches (the counts' memset, sort_count, sort_columns, the 3 scan
 * kernels, sort_rank): a routing plan's sort of 32768 assignments into 32 experts took
 * about 76 us on an H100 (thirty-ninth session's profile), most of it launches and
 * sort_columns' 32 threads walking 128 tiles one after another. Where the items and
 * buckets are few, one block of ONE_WARPS warps does a pass: warp w takes the w-th
 * contiguous segment of the items; (1) each warp counts its segment's buckets into its
 * own row of shared counts; (2) the block scans the counts in (bucket, warp) order, so
 * each (warp, bucket) gets the position of its first item; (3) each warp walks its
 * segment again in order, 32 items at a time, ranking the lanes of one bucket with
 * __match_any_sync, as sort_rank does. The order is by bucket, then by index: the same
 * result as the multi-block pass. Fortieth session, H100, the bench shape: 12 calls of
 * about 51 us in place of 60 us of sort kernels and 3 scans a call. */
#define ONE_WARPS 32
#define ONE_THREADS (ONE_WARPS * 32)
#define ONE_MAX_BUCKETS 256     /* counts of 32 KiB in shared memory */
#define ONE_MAX_ITEMS (1 << 16) /* 64 rounds of 32 items a warp at most */
#define ONE_PER_THREAD (ONE_MAX_BUCKETS * ONE_WARPS / ONE_THREADS)

static __global__ void __launch_bounds__(ONE_THREADS)
    sort_one_block(int *out, int *total, int *bstart, const int32_t *keys, const int *in, int n,
                   int shift, int V, int buckets)
{
    extern __shared__ int cnt[]; /* [ONE_WARPS][buckets]: counts, then positions */
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int seg = (n + ONE_WARPS - 1) / ONE_WARPS;
    const int lo = min(n, warp * seg), hi = min(n, lo + seg);
    for (int i = threadIdx.x; i < ONE_WARPS * buckets; i += ONE_THREADS)
        cnt[i] = 0;
    __syncthreads();
    int *row = cnt + (size_t)warp * buckets;
#pragma unroll 4 /* several loads in flight a lane */
    for (int i = lo + lane; i < hi; i += 32) {
        const int b = sort_bucket(keys, in, i, shift, V);
        if (b >= 0)
            atomicAdd(&row[b], 1);
    }
    __syncthreads();
    /* (bucket, warp) index j = b * ONE_WARPS + w; thread t takes j in [t * per, (t+1) * per) */
    const int cells = buckets * ONE_WARPS;
    const int per = (cells + ONE_THREADS - 1) / ONE_THREADS;
    int v[ONE_PER_THREAD], sum = 0;
#pragma unroll
    for (int q = 0; q < ONE_PER_THREAD; q++) {
        const int j = threadIdx.x * per + q;
        v[q] = q < per && j < cells ? cnt[(j % ONE_WARPS) * buckets + j / ONE_WARPS] : 0;
        sum += v[q];
    }
    int all;
    int pos = block_scan<ONE_WARPS>(sum, &all);
#pragma unroll
    for (int q = 0; q < ONE_PER_THREAD; q++) {
        const int j = threadIdx.x * per + q;
        if (q < per && j < cells) {
            const int w = j % ONE_WARPS, b = j / ONE_WARPS;
            if (w == 0)
                bstart[b] = pos;
            cnt[w * buckets + b] = pos;
            pos += v[q];
        }
    }
    if (threadIdx.x == 0)
        bstart[buckets] = all;
    __syncthreads();
    for (int b = threadIdx.x; b < buckets; b += ONE_THREADS) {
        const int next = b + 1 < buckets ? cnt[b + 1] : all; /* row 0: the bucket starts */
        total[b] = next - cnt[b];
    }
    __syncthreads();
    rank_items(out, row, NULL, keys, in, lo, hi, shift, V); /* positions: absolute */
}

void moe_cuda_sort_take(moe_cuda_sort *s, moe_cuda_carve *c, int n, int V)
{
    const int buckets = V > 0 ? V : RADIX;
    long tiles = (n + SORT_MIN_TILE - 1) / SORT_MIN_TILE;
    long max_tiles = SORT_MAX_CELLS / buckets;
    if (tiles > max_tiles)
        tiles = max_tiles;
    if (tiles < 1)
        tiles = 1;
    int tile = (int)((n + tiles - 1) / tiles);
    tile = tile < 32 ? 32 : (tile + 31) & ~31;
    tiles = (n + tile - 1) / tile;
    s->n = n;
    s->V = V;
    s->passes = V > 0 ? 1 : RADIX_PASSES;
    s->tile = tile;
    s->tiles = tiles < 1 ? 1 : (int)tiles;
    s->order = MOE_CUDA_TAKE(c, int, n);
    s->tmp = V > 0 ? NULL : MOE_CUDA_TAKE(c, int, n);
    s->cnt = MOE_CUDA_TAKE(c, int, (size_t)s->tiles *buckets);
    s->total = MOE_CUDA_TAKE(c, int, buckets);
    s->bstart = MOE_CUDA_TAKE(c, int, buckets + 1);
    s->start = V > 0 ? s->bstart : NULL;
    s->scan = MOE_CUDA_TAKE(c, int, moe_cuda_scan_ints(buckets));
}

void moe_cuda_sort_limit(moe_cuda_sort *s, int limit)
{
    if (s->V > 0 || limit <= 0)
        return;
    int bits = 0;
    while (bits < 31 && (limit - 1) >> bits)
        bits++;
    const int passes = (bits + RADIX_BITS - 1) / RADIX_BITS;
    s->passes = passes <= 2 ? 2 : RADIX_PASSES; /* even: the passes end in s->order */
}

void moe_cuda_sort_run(const moe_cuda_sort *s, const int32_t *keys)
{
    const int buckets = s->V > 0 ? s->V : RADIX;
    if (s->n <= 0) {
        if (s->start)
            MOE_CUDA_OK(
                cudaMemsetAsync(s->start, 0, sizeof(int) * (size_t)(s->V + 1), moe_cuda_stream()));
        return;
    }
    const int *in = NULL;
    if (buckets <= ONE_MAX_BUCKETS && s->n <= ONE_MAX_ITEMS &&
        !moe_cuda_env_is("MOE_SORT_ONE_BLOCK", "0")) { /* read each call: the tests switch it */
        for (int p = 0; p < s->passes; p++) {
            const int shift = s->V > 0 ? -1 : p * RADIX_BITS;
            int *out = s->V > 0 || p % 2 == 1 ? s->order : s->tmp;
            MOE_CUDA_LAUNCH(sort_one_block, 1, ONE_THREADS, sizeof(int) * ONE_WARPS * buckets, out,
                            s->total, s->bstart, keys, in, s->n, shift, s->V, buckets);
            in = out;
        }
        return;
    }
    for (int p = 0; p < s->passes; p++) {
        const int shift = s->V > 0 ? -1 : p * RADIX_BITS;
        /* an even number of radix passes ends in order */
        int *out = s->V > 0 || p % 2 == 1 ? s->order : s->tmp;
        MOE_CUDA_OK(cudaMemsetAsync(s->cnt, 0, sizeof(int) * (size_t)s->tiles * buckets,
                                    moe_cuda_stream()));
        MOE_CUDA_LAUNCH(sort_count, s->tiles, MOE_CUDA_THREADS, 0, s->cnt, keys, in, s->n, s->tile,
                        shift, s->V, buckets);
        MOE_CUDA_LAUNCH(sort_columns, moe_cuda_blocks(buckets, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                        0, s->cnt, s->total, s->tiles, buckets);
        moe_cuda_scan(s->bstart, s->total, buckets, s->scan);
        MOE_CUDA_LAUNCH(sort_rank, s->tiles, 32, 0, out, s->cnt, s->bstart, keys, in, s->n, s->tile,
                        shift, s->V, buckets);
        in = out;
    }
}
