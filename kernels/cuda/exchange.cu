/* kernels/cuda/exchange.cu: packing and unpacking the rows that travel between ranks in
 * the MoE dispatch and combine (row layout in ops.h). moe_pack_dispatch counts the rows
 * of each tile of 32 (destination, token) pairs (and the counts), keeping each tile's
 * ballot of the pairs that send a row; the fill numbers each tile's rows from that ballot
 * in (destination, token) order -- the reference's order -- after the rows of the tiles
 * before it (each block sums their counts where the tiles are few, else one scan does),
 * while it fills them (one block a tile: the row count stays on the device); its first
 * block stores the counts into the caller's pinned host memory (or one copy is queued):
 * nothing waits, the caller reads them after its queue_wait; with them, the inverse map
 * token_rows. The gradient scatter gathers each token's rows through that map (or,
 * without it, sorts the rows by token) and adds them in row order (deterministic). */
#include "kernels/cuda/cuda_common.cuh"

/* Is assignment a (kept) on destination p? */
static __device__ __forceinline__ int on_dest(const int32_t *idx, const int32_t *slot_row,
                                              const int32_t *expert_rank, int a, int p)
{
    return slot_row[a] >= 0 && expert_rank[idx[a]] == p;
}

/* Pairs i = p*N + t (destination p, token t) go in tiles of 32, one warp's: the tile's
 * rows are numbered from the rows of the tiles before it, each pair's row within its tile
 * from the warp's ballot of the pairs that send one. */
#define PAIR_TILE 32

/* One thread per pair: tile_rows[tile] = the rows of each tile of PAIR_TILE pairs and
 * tile_mask[tile] its ballot (bit j: pair j sends a row: some kept slot of its token has
 * its expert on its destination); the counts res (MOE_PACK_COUNTS: rows per destination,
 * kept slots per destination, rows in all, kept slots per destination and local expert
 * when El > 0), added to. Integer atomics: the counts do not depend on the order. SHARED:
 * the block's counts are gathered in shared memory first (res's cells but the total),
 * then added with one global atomic a block and count that is not 0 (the default where
 * the counts fit; MOE_DISPATCH_FLAGS_SHARED=0: global atomics only. At ep 1 every kept
 * slot adds 1 to one of E global counts and every token to res[0] and res[1]: on an H100,
 * 16384 tokens, the counts took 20 us with global atomics, 5.7 us with shared ones,
 * fortieth session). With part (SHARED only), every block stores its cells there instead
 * (part[block][cell]) and the fill's first block adds them up (no memset of res and no
 * atomics into it). The same integer sums either way. */
#define FLAGS_SHARED_MAX 4096 /* 2P + P * El: 16 KiB of shared memory */
template <bool SHARED>
static __global__ void
dispatch_count_kernel(int *tile_rows, unsigned *tile_mask, int *res, int *part, const int32_t *idx,
                      const int32_t *slot_row, const int32_t *expert_rank,
                      const int32_t *expert_local, int N, int K, int P, int El)
{
    extern __shared__ int sh[]; /* SHARED: rows (P), kept (P), then experts (P * El) */
    const int cells = 2 * P + P * El;
    if (SHARED) {
        for (int c = threadIdx.x; c < cells; c += blockDim.x)
            sh[c] = 0;
        __syncthreads();
    }
    int *to = SHARED ? sh : res, *to_experts = SHARED ? sh + 2 * P : res + 2 * P + 1;
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    int kept = 0;
    if (i < (size_t)P * N) {
        const int p = (int)(i / N), t = (int)(i % N);
        for (int k = 0; k < K; k++) {
            const int a = t * K + k;
            if (on_dest(idx, slot_row, expert_rank, a, p)) {
                kept++;
                if (El > 0)
                    atomicAdd(&to_experts[(size_t)p * El + expert_local[idx[a]]], 1);
            }
        }
        if (kept) {
            atomicAdd(&to[p], 1);
            atomicAdd(&to[P + p], kept);
            if (!SHARED)
                atomicAdd(&res[2 * P], 1);
        }
    }
    const unsigned ballot = __ballot_sync(MOE_CUDA_FULL_MASK, kept > 0);
    if ((threadIdx.x & 31) == 0 && i < (size_t)P * N) {
        tile_rows[i / PAIR_TILE] = __popc(ballot);
        tile_mask[i / PAIR_TILE] = ballot;
    }
    if (SHARED && part) { /* every cell of the block's counts, summed by the fill */
        __syncthreads();
        for (int c = threadIdx.x; c < cells; c += blockDim.x)
            part[(size_t)blockIdx.x * cells + c] = sh[c];
    } else if (SHARED) {
        __syncthreads();
        for (int c = threadIdx.x; c < cells; c += blockDim.x)
            if (sh[c]) {
                atomicAdd(c < 2 * P ? &res[c] : &res[c + 1], sh[c]);
                if (c < P)
                    atomicAdd(&res[2 * P], sh[c]);
            }
    }
}

/* Values i .. i + V - 1 of a row's token part (x16 its format; V = 4: i % 4 == 0, the
 * row 8-byte aligned; V = 8: i % 8 == 0, the row 16-byte aligned), written and read. */
template <int V>
static __device__ __forceinline__ void row_store(char *row, int i, const moe_fvec<V> &r, int x16)
{
    if (x16 == MOE_ROW_FP32) {
        if constexpr (V == 8) { /* 16-byte aligned: two float4 */
            moe_store_v<8>((real *)row + i, r);
        } else if constexpr (V == 4) { /* rows are 8-byte aligned: two 8-byte stores */
            ((float2 *)row)[i / 2] = make_float2(r.v[0], r.v[1]);
            ((float2 *)row)[i / 2 + 1] = make_float2(r.v[2], r.v[3]);
        } else {
            ((real *)row)[i] = r.v[0];
        }
    } else if constexpr (V == 8) {
        moe_store16_v<8>((uint16_t *)row + i, r, x16 == MOE_ROW_BF16);
    } else if constexpr (V == 4) {
        ((uint2 *)row)[i / 4] =
            moe_round16x4(make_float4(r.v[0], r.v[1], r.v[2], r.v[3]), x16 == MOE_ROW_BF16);
    } else {
        ((uint16_t *)row)[i] = moe_round16(r.v[0], x16 == MOE_ROW_BF16);
    }
}

template <int V>
static __device__ __forceinline__ moe_fvec<V> row_load(const char *row, int i, int x16)
{
    if (x16 != MOE_ROW_FP32)
        return moe_ld_v<V, 1>(row, (size_t)i, x16 == MOE_ROW_BF16);
    if constexpr (V == 8) /* 16-byte aligned: two float4 */
        return moe_ld_v<8, 0>(row, (size_t)i, 0);
    moe_fvec<V> r;
    if constexpr (V == 4) { /* two 8-byte loads */
        const float2 a = ((const float2 *)row)[i / 2], b = ((const float2 *)row)[i / 2 + 1];
        r.v[0] = a.x, r.v[1] = a.y, r.v[2] = b.x, r.v[3] = b.y;
    } else {
        r.v[0] = ((const real *)row)[i];
    }
    return r;
}

/* The token values a thread moves between the rows and an (n, D) buffer `x` (row_load,
 * row_store): 8 (16-byte accesses) where D % 8 == 0, the rows 16-byte aligned
 * (row_bytes % 16 == 0) and both buffers too; 4 where D % 4 == 0 and row_bytes % 8 == 0;
 * else 1. MOE_EXCHANGE_ROWS_V8=0: at most 4 (the benchmark's comparison, the tests'
 * 4-value path). */
static int rows_vec(int D, size_t row_bytes, const void *rows, const void *x)
{
    if (!moe_aligned16(rows) || !moe_aligned16(x))
        return 1;
    if (D % 8 == 0 && row_bytes % 16 == 0 && !moe_cuda_env_is("MOE_EXCHANGE_ROWS_V8", "0"))
        return 8;
    return D % 4 == 0 && row_bytes % 8 == 0 ? 4 : 1;
}

/* The counts straight to the caller's pinned host memory (no memset, no copy): the count
 * kernel's per-block cells part[nparts][cells] (rows and kept slots per destination, then
 * kept slots per destination and local expert), added up by the fill's first block in
 * shared memory and stored at `host` in MOE_PACK_COUNTS's order, the total of rows after
 * the first 2P. Where the cells are at most COUNTS_DIRECT_CELLS, part at most
 * COUNTS_DIRECT_PARTS ints, and `host` is device-mapped (cudaMallocHost's); else (or
 * MOE_DISPATCH_COUNTS_DIRECT=0) a memset, atomics into res and a copy to the host. The
 * same integer sums either way. */
#define COUNTS_DIRECT_CELLS 1024
#define COUNTS_DIRECT_PARTS 65536
struct pack_counts {
    const int *part; /* NULL: the counts go by res and a copy */
    int *host;       /* device-mapped pinned host memory */
    int nparts, cells;
};

static __device__ __noinline__ void pack_counts_store(const pack_counts &pc, int P)
{
    __shared__ int sum[COUNTS_DIRECT_CELLS + 1]; /* the cells, then the total of rows */
    for (int c = threadIdx.x; c <= pc.cells; c += blockDim.x)
        sum[c] = 0;
    __syncthreads();
    const size_t n = (size_t)pc.nparts * pc.cells;
    for (size_t e = threadIdx.x; e < n; e += blockDim.x) {
        const int c = (int)(e % pc.cells), v = pc.part[e];
        if (v) {
            atomicAdd(&sum[c], v);
            if (c < P)
                atomicAdd(&sum[pc.cells], v);
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c <= pc.cells; c += blockDim.x)
        pc.host[c == pc.cells ? 2 * P : c < 2 * P ? c : c + 1] = sum[c];
}

/* Where the tiles are at most this many, each fill block sums the row counts of the
 * tiles before it (at most 8 KiB read, from L2) instead of a scan's launch before the
 * fill (MOE_DISPATCH_FILL_SUMS=0: the scan always). */
#define FILL_SUMS_MAX 2048

/* One block per tile of PAIR_TILE pairs: its first row is tile_start[tile] (the scan of
 * the tiles' rows) or, tile_start NULL, the sum of tile_rows over the tiles before it
 * (its threads' shares, added by shuffles and the warps' sums); each pair's row from
 * there by the tile's ballot tile_mask (the pairs before it that send one). The first warp
 * writes send_token and token_rows; then the block's threads store the K weights and K
 * expert ids of all its rows, one a (pair, slot), and each warp fills whole rows' tokens,
 * its lanes in groups of V values (rows_vec). rows NULL: send_token and token_rows only.
 * X16: x is marked as holding 16-bit values (bf16 by `bf16`), read as such. RAW (X16, V
 * 8, x in the rows' own format): the bits copied. */
template <int V, bool X16, bool RAW>
static __global__ void
dispatch_fill_kernel(char *rows, int32_t *send_token, int32_t *token_rows, const int *tile_start,
                     const int *tile_rows, const unsigned *tile_mask, const real *x,
                     const int32_t *idx, const real *w, const int32_t *slot_row,
                     const int32_t *expert_rank, const int32_t *expert_local, int N, int P, int D,
                     int K, size_t row_bytes, int x16, int bf16, pack_counts pc)
{
    __shared__ int warp_rows[MOE_CUDA_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x / 32;
    const size_t i0 = (size_t)blockIdx.x * PAIR_TILE, PN = (size_t)P * N;
    const unsigned mask = tile_mask[blockIdx.x];
    if (pc.part && blockIdx.x == 0)
        pack_counts_store(pc, P);
    int start = 0;
    if (tile_start) {
        start = tile_start[blockIdx.x];
    } else {
        int s = 0;
        for (int c = threadIdx.x; c < (int)blockIdx.x; c += blockDim.x)
            s += tile_rows[c];
        for (int o = 16; o > 0; o >>= 1)
            s += __shfl_xor_sync(MOE_CUDA_FULL_MASK, s, o);
        if (lane == 0)
            warp_rows[warp] = s;
        __syncthreads();
        for (int u = 0; u < warps; u++)
            start += warp_rows[u];
    }
    if (warp == 0) {
        const size_t i = i0 + lane;
        const int row = mask >> lane & 1u ? start + __popc(mask & ((1u << lane) - 1)) : -1;
        if (i < PN) {
            if (token_rows)
                token_rows[(i % N) * P + i / N] = row;
            if (row >= 0)
                send_token[row] = (int32_t)(i % N);
        }
    }
    if (!rows)
        return;
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    /* the weights and ids of all the tile's rows first, one thread a (pair, slot): their
     * dependent loads (idx, then expert_rank and expert_local) in flight together, not
     * one row's after another's tokens */
    for (int e = threadIdx.x; e < PAIR_TILE * K; e += blockDim.x) {
        const int j = e / K, k = e % K;
        if (!(mask >> j & 1u))
            continue;
        const int r = start + __popc(mask & ((1u << j) - 1));
        const int p = (int)((i0 + j) / N), a = (int)((i0 + j) % N) * K + k;
        const int here = on_dest(idx, slot_row, expert_rank, a, p);
        real *wt = (real *)(rows + (size_t)r * row_bytes + tb);
        wt[k] = here ? w[a] : (real)0;
        ((int32_t *)(wt + K))[k] = here ? expert_local[idx[a]] : -1;
    }
    for (int j = warp; j < PAIR_TILE; j += warps) {
        if (!(mask >> j & 1u))
            continue;
        const int r = start + __popc(mask & ((1u << j) - 1));
        const int t = (int)((i0 + j) % N);
        char *row = rows + (size_t)r * row_bytes;
        const size_t xt = (size_t)t * D; /* x's element index (16-bit ones when X16) */
        int g = lane;
        if constexpr (RAW) { /* the row's bits are x's: 16 bytes a group, copied */
            const uint4 *xs = (const uint4 *)x + xt / 8;
            for (; g + 3 * 32 < D / 8; g += 4 * 32) {
                uint4 f[4];
                for (int u = 0; u < 4; u++)
                    f[u] = xs[g + u * 32];
                for (int u = 0; u < 4; u++)
                    ((uint4 *)row)[g + u * 32] = f[u];
            }
            for (; g < D / 8; g += 32)
                ((uint4 *)row)[g] = xs[g];
        }
        for (; !RAW && g + 3 * 32 < D / V; g += 4 * 32) { /* four loads in flight, then stores */
            moe_fvec<V> f[4];
            for (int u = 0; u < 4; u++)
                f[u] = moe_ld_v<V, X16>(x, xt + (size_t)(g + u * 32) * V, bf16);
            for (int u = 0; u < 4; u++)
                row_store<V>(row, (g + u * 32) * V, f[u], x16);
        }
        for (; !RAW && g < D / V; g += 32)
            row_store<V>(row, g * V, moe_ld_v<V, X16>(x, xt + (size_t)g * V, bf16), x16);
    }
}

/* The device's address of pinned host memory `counts` (cudaMallocHost's: mapped), or NULL
 * where it has none (pageable memory: the counts then go by a copy). */
static int *counts_device(int *counts)
{
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, counts) != cudaSuccess) {
        (void)cudaGetLastError(); /* not the stream's error: the copy serves */
        return NULL;
    }
    return a.type == cudaMemoryTypeHost ? (int *)a.devicePointer : NULL;
}

extern "C" void cuda_moe_pack_dispatch(char *rows, int32_t *send_token, int32_t *token_rows,
                                       int *counts, const real *x, const int32_t *idx,
                                       const real *w, const int32_t *slot_row,
                                       const int32_t *expert_rank, const int32_t *expert_local,
                                       int N, int D, int K, int P, int El, size_t row_bytes,
                                       int x16)
{
    const size_t n_counts = (size_t)MOE_PACK_COUNTS(P, El);
    if (N <= 0 || P <= 0) {
        memset(counts, 0, sizeof(int) * n_counts);
        return;
    }
    const size_t PN = (size_t)P * N;
    const int tiles = (int)((PN + PAIR_TILE - 1) / PAIR_TILE);
    const bool sums = tiles <= FILL_SUMS_MAX && !moe_cuda_env_is("MOE_DISPATCH_FILL_SUMS", "0");
    const size_t cells = 2 * (size_t)P + (size_t)P * (El > 0 ? El : 0);
    const bool shared =
        cells <= FLAGS_SHARED_MAX && !moe_cuda_env_is("MOE_DISPATCH_FLAGS_SHARED", "0");
    const unsigned count_blocks = (unsigned)((PN + MOE_CUDA_THREADS - 1) / MOE_CUDA_THREADS);
    pack_counts pc = {NULL, NULL, (int)count_blocks, (int)cells};
    const bool direct = shared && cells <= COUNTS_DIRECT_CELLS &&
                        (size_t)count_blocks * cells <= COUNTS_DIRECT_PARTS &&
                        !moe_cuda_env_is("MOE_DISPATCH_COUNTS_DIRECT", "0") &&
                        (pc.host = counts_device(counts)) != NULL;
    moe_cuda_carve c = {NULL, 0};
    int *tile_rows = NULL, *tile_start = NULL, *scan = NULL, *res = NULL, *part = NULL;
    unsigned *tile_mask = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1 && !moe_cuda_carve_alloc(&c))
            return;
        tile_rows = MOE_CUDA_TAKE(&c, int, tiles);
        tile_mask = MOE_CUDA_TAKE(&c, unsigned, tiles);
        tile_start = sums ? NULL : MOE_CUDA_TAKE(&c, int, tiles + 1);
        scan = sums ? NULL : MOE_CUDA_TAKE(&c, int, moe_cuda_scan_ints(tiles));
        res = direct ? NULL : MOE_CUDA_TAKE(&c, int, n_counts);
        part = direct ? MOE_CUDA_TAKE(&c, int, (size_t)count_blocks *cells) : NULL;
    }
    pc.part = part;
    if (!direct)
        MOE_CUDA_OK(cudaMemsetAsync(res, 0, sizeof(int) * n_counts, moe_cuda_stream()));
    moe_cuda_pick(
        [&](auto shared_) {
            constexpr bool S = decltype(shared_)::value;
            MOE_CUDA_LAUNCH(dispatch_count_kernel<S>, count_blocks, MOE_CUDA_THREADS,
                            S ? sizeof(int) * cells : 0, tile_rows, tile_mask, res, part, idx,
                            slot_row, expert_rank, expert_local, N, K, P, El > 0 ? El : 0);
        },
        shared);
    if (!sums)
        moe_cuda_scan(tile_start, tile_rows, tiles, scan);
    int bf16 = 0;
    const bool in16 = rows && cuda_operand_in_place(x, (size_t)N * D, &bf16);
    const int vec = rows ? rows_vec(D, row_bytes, rows, x) : 1;
    /* 16-bit x in the rows' own format, 8 values a thread: the bits copied */
    const bool raw =
        in16 && vec == 8 && x16 != MOE_ROW_FP32 && (x16 == MOE_ROW_BF16) == (bf16 != 0);
    moe_cuda_pick(
        [&](auto v8_, auto v4_, auto in16_, auto raw_) {
            constexpr int V = decltype(v8_)::value ? 8 : decltype(v4_)::value ? 4 : 1;
            constexpr bool X16 = decltype(in16_)::value, RAW = decltype(raw_)::value;
            if constexpr (!RAW || (V == 8 && X16)) /* raw implies both */
                MOE_CUDA_LAUNCH((dispatch_fill_kernel<V, X16, RAW>), (unsigned)tiles,
                                MOE_CUDA_THREADS, 0, rows, send_token, token_rows, tile_start,
                                tile_rows, tile_mask, x, idx, w, slot_row, expert_rank,
                                expert_local, N, P, D, K, row_bytes, x16, bf16, pc);
        },
        vec == 8, vec == 4, in16, raw);
    if (!direct)
        moe_cuda_fetch_async(counts, res, sizeof(int) * n_counts);
}

/* Values at .. at + V - 1 of an (n, D) buffer x: 16-bit ones where O16 (bf16 by `bf16`). */
template <int V, bool O16>
static __device__ __forceinline__ void x_store(real *x, size_t at, const moe_fvec<V> &f, int bf16)
{
    if (O16)
        moe_store16_v<V>((uint16_t *)x + at, f, bf16);
    else
        moe_store_v<V>(x + at, f);
}

/* x (R,D), w (R,K), lidx (R,K) from the rows: one thread per group of V token values
 * (rows_vec) or per weight or id. O16: x is
 * marked as holding 16-bit values (bf16 by `bf16`; the rows' own where they are 16-bit:
 * copied exactly). */
template <int V, bool O16>
static __global__ void unpack_kernel(real *x, real *w, int32_t *lidx, const char *rows, int R,
                                     int D, int K, size_t row_bytes, int x16, int bf16)
{
    const int GD = x ? D / V : 0, W = GD + 2 * K; /* x NULL: the weights and ids only */
    const size_t tb = moe_dispatch_token_bytes(D, x16);
    MOE_CUDA_GRID_STRIDE(e, (size_t)R * W)
    {
        const int r = (int)(e / W), j = (int)(e % W);
        const char *row = rows + (size_t)r * row_bytes;
        const real *wt = (const real *)(row + tb);
        if (j < GD) {
            x_store<V, O16>(x, (size_t)r * D + (size_t)j * V, row_load<V>(row, j * V, x16), bf16);
        } else if (j < GD + K) {
            w[(size_t)r * K + j - GD] = wt[j - GD];
        } else {
            lidx[(size_t)r * K + j - GD - K] = ((const int32_t *)(wt + K))[j - GD - K];
        }
    }
}

/* The same by whole rows: one warp a row (the grid's warps striding over them), its lanes
 * in groups of V token values, four loads in flight before their stores while 4 * 32
 * groups remain, then its first K lanes the weights and ids. */
template <int V, bool O16>
static __global__ void unpack_rows_kernel(real *x, real *w, int32_t *lidx, const char *rows, int R,
                                          int D, int K, size_t row_bytes, int x16, int bf16)
{
    const int lane = threadIdx.x & 31, GD = D / V; /* x is not NULL (the caller's rule) */
    const size_t tb = moe_dispatch_token_bytes(D, x16), warps = (size_t)gridDim.x * blockDim.x / 32;
    for (size_t r = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; r < (size_t)R;
         r += warps) {
        const char *row = rows + r * row_bytes;
        real *xr = x + r * D;
        int g = lane;
        for (; g + 3 * 32 < GD; g += 4 * 32) {
            moe_fvec<V> f[4];
            for (int u = 0; u < 4; u++)
                f[u] = row_load<V>(row, (g + u * 32) * V, x16);
            for (int u = 0; u < 4; u++)
                x_store<V, O16>(xr, (size_t)(g + u * 32) * V, f[u], bf16);
        }
        for (; g < GD; g += 32)
            x_store<V, O16>(xr, (size_t)g * V, row_load<V>(row, g * V, x16), bf16);
        const real *wt = (const real *)(row + tb);
        for (int k = lane; k < K; k += 32) {
            w[r * K + k] = wt[k];
            lidx[r * K + k] = ((const int32_t *)(wt + K))[k];
        }
    }
}

/* Whole rows a warp (unpack_rows_kernel) where each row has at least 32 groups of token
 * values (MOE_UNPACK_ROWS=0: one thread a group always). */
extern "C" void cuda_moe_unpack_dispatch(real *x, real *w, int32_t *lidx, const char *rows, int R,
                                         int D, int K, size_t row_bytes, int x16)
{
    if (R <= 0 || D + 2 * K <= 0)
        return;
    int bf16 = 0;
    const bool o16 = x && cuda_operand_in_place(x, (size_t)R * D, &bf16);
    const int vec = rows_vec(D, row_bytes, rows, x);
    const size_t items = (size_t)R * ((x ? D / vec : 0) + 2 * K);
    if (!items)
        return;
    const bool whole = x && D / vec >= 32 && !moe_cuda_env_is("MOE_UNPACK_ROWS", "0");
    moe_cuda_pick(
        [&](auto v8_, auto v4_, auto o16_) {
            constexpr int V = decltype(v8_)::value ? 8 : decltype(v4_)::value ? 4 : 1;
            constexpr bool O16 = decltype(o16_)::value;
            if (whole)
                MOE_CUDA_LAUNCH((unpack_rows_kernel<V, O16>),
                                moe_cuda_blocks((size_t)R * 32, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                                0, x, w, lidx, rows, R, D, K, row_bytes, x16, bf16);
            else
                MOE_CUDA_LAUNCH((unpack_kernel<V, O16>), moe_cuda_blocks(items, MOE_CUDA_THREADS),
                                MOE_CUDA_THREADS, 0, x, w, lidx, rows, R, D, K, row_bytes, x16,
                                bf16);
        },
        vec == 8, vec == 4, o16);
}

/* out row m = the token of dispatch row row_token[m], in groups of V values (rows_vec);
 * O16: out is marked (the experts' input),
 * so it gets 16-bit values (the rows' own where they are 16-bit: copied exactly). */
template <int V, bool O16>
static __global__ void permute_rows_kernel(real *out, const char *rows, size_t row_bytes, int x16,
                                           const int32_t *row_token, int M, int D, int bf16)
{
    const int G = D / V;
    MOE_CUDA_GRID_STRIDE(e, (size_t)M * G)
    {
        const size_t m = e / G;
        const int d = (int)(e % G) * V;
        x_store<V, O16>(out, m * D + d,
                        row_load<V>(rows + (size_t)row_token[m] * row_bytes, d, x16), bf16);
    }
}

extern "C" void cuda_moe_permute_rows(real *out, const char *rows, size_t row_bytes, int x16,
                                      const int32_t *row_token, int M, int D)
{
    if (M <= 0 || D <= 0)
        return;
    int bf16 = 0;
    const bool o16 = cuda_operand_in_place(out, (size_t)M * D, &bf16);
    const int vec = rows_vec(D, row_bytes, rows, out);
    const size_t items = (size_t)M * (D / vec);
    moe_cuda_pick(
        [&](auto v8_, auto v4_, auto o16_) {
            constexpr int V = decltype(v8_)::value ? 8 : decltype(v4_)::value ? 4 : 1;
            constexpr bool O16 = decltype(o16_)::value;
            MOE_CUDA_LAUNCH((permute_rows_kernel<V, O16>), moe_cuda_blocks(items, MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, out, rows, row_bytes, x16, row_token, M, D, bf16);
        },
        vec == 8, vec == 4, o16);
}

/* One thread per V values of a row (V = 2: D and K even, the arrays 8-byte aligned, so a
 * pair never straddles the two parts): rows (R, D+K) = [0 | dw], the start of
 * moe_pack_grad_rows's sums where they run over sorted rows. */
template <int V>
static __global__ void grad_rows_start_kernel(real *rows, const real *dw, int R, int D, int K)
{
    const int W = (D + K) / V;
    MOE_CUDA_GRID_STRIDE(e, (size_t)R * W)
    {
        const size_t r = e / W;
        const int j = (int)(e % W) * V;
        if constexpr (V == 2)
            *(float2 *)(rows + e * 2) =
                j < D ? make_float2(0.f, 0.f) : *(const float2 *)(dw + r * K + (j - D));
        else
            rows[e] = j < D ? 0.f : dw[r * K + (j - D)];
    }
}

/* rows[r] = [dout[m] + ... over the expert rows m of received row r, in row order | dw[r]]
 * (moe_pack_grad_rows): the sums of moe_permute_backward from 0, stored at the row's
 * stride D + K; the dw columns' values are not sums (value 0, the store takes dw's). Any
 * row of dout may be read (any_item). Two forms (quad, chosen by grad_rows_quad):
 * - columns D + K (quad false): one or two values a thread, a pair never straddling the
 *   two parts (D, K even);
 * - columns D (quad true: D % 4 == 0, K even, dout 16-byte and the rows 8-byte aligned):
 *   4 values a thread, dout read in 16 bytes and the row stored in two 8-byte halves (its
 *   stride D + K is only even), column 0's thread storing the row's K dw values too. */
struct grad_rows {
    real *rows;
    const real *dout, *dw;
    int D, K;
    bool quad;
    static constexpr bool vec4 = true; /* over the D columns only (quad) */
    static constexpr bool vec2 = true; /* D, K even: a pair never straddles the parts */
    static constexpr bool weighted = false, any_item = true;
    bool aligned16() const { return quad; }
    bool aligned8() const
    {
        return D % 2 == 0 && K % 2 == 0 && moe_aligned8(rows) && moe_aligned8(dout) &&
               moe_aligned8(dw);
    }
    void start(int R) const
    {
        if (R <= 0 || D + K <= 0)
            return;
        if (aligned8())
            MOE_CUDA_LAUNCH(grad_rows_start_kernel<2>,
                            moe_cuda_blocks((size_t)R * ((D + K) / 2), MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, rows, dw, R, D, K);
        else
            MOE_CUDA_LAUNCH(grad_rows_start_kernel<1>,
                            moe_cuda_blocks((size_t)R * (D + K), MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, rows, dw, R, D, K);
    }
    __device__ float load(int, int) const { return 0.f; }
    __device__ float value(int m, int j) const { return j < D ? dout[(size_t)m * D + j] : 0.f; }
    __device__ void store(int r, int j, float v) const
    {
        rows[(size_t)r * (D + K) + j] = j < D ? v : dw[(size_t)r * K + (j - D)];
    }
    __device__ float2 load2(int, int) const { return make_float2(0.f, 0.f); }
    __device__ float2 value2(int m, int j) const
    {
        return j < D ? *(const float2 *)(dout + (size_t)m * D + j) : make_float2(0.f, 0.f);
    }
    __device__ void store2(int r, int j, float2 v) const
    {
        *(float2 *)(rows + (size_t)r * (D + K) + j) =
            j < D ? v : *(const float2 *)(dw + (size_t)r * K + (j - D));
    }
    __device__ float4 load4(int, int) const { return make_float4(0.f, 0.f, 0.f, 0.f); }
    __device__ float4 value4(int m, int j) const
    {
        return *(const float4 *)(dout + (size_t)m * D + j);
    }
    __device__ void store4(int r, int j, float4 v) const
    {
        float2 *at = (float2 *)(rows + (size_t)r * (D + K) + j);
        at[0] = make_float2(v.x, v.y);
        at[1] = make_float2(v.z, v.w);
        if (j == 0) /* the 4-value form only (quad): column 0's thread stores dw too */
            for (int k = 0; k < K; k++)
                rows[(size_t)r * (D + K) + D + k] = dw[(size_t)r * K + k];
    }
};

/* Whether moe_pack_grad_rows takes grad_rows's 4-value form (its columns D). */
static bool grad_rows_quad(const real *rows, const real *dout, const real *dw, int D, int K)
{
    return D > 0 && D % 4 == 0 && K % 2 == 0 && moe_aligned16(dout) && moe_aligned8(rows) &&
           moe_aligned8(dw);
}

extern "C" void cuda_moe_pack_grad_rows(real *rows, const real *dout, const int32_t *row_token,
                                        int M, const int32_t *slot_row, const real *dw, int R,
                                        int D, int K)
{
    const bool quad = grad_rows_quad(rows, dout, dw, D, K);
    grad_rows op = {rows, dout, dw, D, K, quad};
    moe_cuda_token_sums(op, row_token, M, quad ? D : D + K, slot_row, R, K);
}

/* dx[token] = base[token] + row[0..D) ..., dw[token] = row[D..D+K) ..., rows of a token
 * in row order. */
struct scatter_grad {
    real *dx, *dw;
    const real *base, *rows;
    int D, K;
    static constexpr bool vec4 = false; /* a row's columns go to two arrays */
    static constexpr bool vec2 = true;  /* D, K even: a pair never straddles them */
    static constexpr bool weighted = false;
    bool aligned16() const { return false; }
    bool aligned8() const
    {
        return D % 2 == 0 && K % 2 == 0 && moe_aligned8(dx) && moe_aligned8(dw) &&
               moe_aligned8(rows) && (!base || moe_aligned8(base));
    }
    void start(int N) const
    {
        moe_cuda_rows_base(dx, base, N, D);
        moe_cuda_rows_base(dw, NULL, N, K);
    }
    __device__ float *dst(int t, int j) const
    {
        return j < D ? dx + (size_t)t * D + j : dw + (size_t)t * K + (j - D);
    }
    __device__ float load(int t, int j) const
    {
        return j < D ? moe_base_value(base, (size_t)t * D + j) : 0.f;
    }
    __device__ float value(int r, int j) const { return rows[(size_t)r * (D + K) + j]; }
    __device__ void store(int t, int j, float v) const { *dst(t, j) = v; }
    __device__ float2 load2(int t, int j) const
    {
        return j < D && base ? *(const float2 *)(base + (size_t)t * D + j) : make_float2(0.f, 0.f);
    }
    __device__ float2 value2(int r, int j) const
    {
        return *(const float2 *)(rows + (size_t)r * (D + K) + j);
    }
    __device__ void store2(int t, int j, float2 v) const { *(float2 *)dst(t, j) = v; }
};

extern "C" void cuda_moe_scatter_grad_rows(real *dx, real *dw, const real *base, const real *rows,
                                           const int32_t *send_token, int n, int D, int K,
                                           const int32_t *token_rows, int N, int P)
{
    scatter_grad op = {dx, dw, base, rows, D, K};
    moe_cuda_token_sums(op, send_token, n, D + K, token_rows, N, P);
}
