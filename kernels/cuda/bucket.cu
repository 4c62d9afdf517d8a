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

/* Exclusive scan over the MOE_CUDA_THREADS threads of a block, in thread order; *total
 * gets the block's sum. Every thread of the block must call it. */
static __device__ int block_scan(int v, int *total)
{
    __shared__ int warp_total[MOE_CUDA_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        int y = __shfl_up_sync(MOE_CUDA_FULL_MASK, x, o);
        if (lane >= o)
            x += y;
    }
    __syncthreads(); /* warp_total may still be read by a previous call */
    if (lane == 31)
        warp_total[warp] = x;
    __syncthreads();
    int before = 0, all = 0;
    for (int w = 0; w < MOE_CUDA_THREADS / 32; w++) {
        int t = warp_total[w];
        before += w < warp ? t : 0;
        all += t;
    }
    *total = all;
    return before + x - v;
}

static __global__ void scan_tile_sums(int *sums, const int *in, int n)
{
    const int base = blockIdx.x * SCAN_TILE + threadIdx.x * SCAN_ITEMS;
    int s = 0, total;
    for (int j = 0; j < SCAN_ITEMS; j++)
        if (base + j < n)
            s += in[base + j];
    block_scan(s, &total);
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
        const int p = block_scan(v, &total);
        if (i < nb)
            sums[i] = carry + p;
        carry += total;
    }
    if (threadIdx.x == 0) {
        sums[nb] = carry;
        *grand = carry;
    }
}

static __global__ void scan_tiles(int *out, const int *in, int n, const int *sums)
{
    const int base = blockIdx.x * SCAN_TILE + threadIdx.x * SCAN_ITEMS;
    int v[SCAN_ITEMS], s = 0, total;
    for (int j = 0; j < SCAN_ITEMS; j++) {
        v[j] = base + j < n ? in[base + j] : 0;
        s += v[j];
    }
    int p = block_scan(s, &total) + sums[blockIdx.x];
    for (int j = 0; j < SCAN_ITEMS; j++)
        if (base + j < n) {
            out[base + j] = p;
            p += v[j];
        }
}

size_t moe_cuda_scan_ints(int n) { return (size_t)(n + SCAN_TILE - 1) / SCAN_TILE + 1; }

void moe_cuda_scan(int *out, const int *in, int n, int *scratch)
{
    if (n <= 0) {
        MOE_CUDA_OK(cudaMemsetAsync(out, 0, sizeof(int), moe_cuda_stream()));
        return;
    }
    const int nb = (n + SCAN_TILE - 1) / SCAN_TILE;
    MOE_CUDA_LAUNCH(scan_tile_sums, nb, MOE_CUDA_THREADS, 0, scratch, in, n);
    MOE_CUDA_LAUNCH(scan_sums, 1, MOE_CUDA_THREADS, 0, scratch, nb, out + n);
    MOE_CUDA_LAUNCH(scan_tiles, nb, MOE_CUDA_THREADS, 0, out, in, n, scratch);
}

/* ---- stable sort --------------------------------------------------------------------- */

/* Bucket of item i (at position i of the input order `in`, identity when NULL): its key's
 * digit at `shift` (radix pass), or the key itself when in [0, V), else -1 (left out). */
static __device__ __forceinline__ int sort_bucket(const int32_t *keys, const int *in, int i,
                                                  int shift, int V)
{
    const int k = keys[in ? in[i] : i];
    if (shift >= 0)
        return (k >> shift) & (RADIX - 1);
    return k >= 0 && k < V ? k : -1;
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

/* One warp per tile, in item order: out[start[b] + tile base[b] + rank] = item. */
static __global__ void sort_rank(int *out, int *cnt, const int *start, const int32_t *keys,
                                 const int *in, int n, int tile, int shift, int V, int buckets)
{
    const int lane = threadIdx.x;
    const int lo = blockIdx.x * tile, hi = min(n, lo + tile);
    volatile int *cursor = cnt + (size_t)blockIdx.x * buckets;
    for (int i0 = lo; i0 < hi; i0 += 32) {
        const int i = i0 + lane;
        const int b = i < hi ? sort_bucket(keys, in, i, shift, V) : -1;
        const unsigned peers = __match_any_sync(MOE_CUDA_FULL_MASK, b);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        const int base = b >= 0 ? cursor[b] : 0;
        __syncwarp();
        if (b >= 0) {
            out[start[b] + base + rank] = in ? in[i] : i;
            if (rank == 0)
                cursor[b] = base + __popc(peers);
        }
        __syncwarp();
    }
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
