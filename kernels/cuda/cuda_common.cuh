/* kernels/cuda/cuda_common.cuh: what the .cu files of the "cuda" backend share: the one
 * stream, the sticky error status, device and pinned scratch, launch helpers, warp
 * reductions, the scan and the stable sort (bucket.cu), and the declarations of every
 * cuda_<op> (same parameter list as the op in kernels/ops.h).
 *
 * Owns nothing at run time (backend_cuda.cu owns the state). Every function here is host
 * code called on the backend's thread; every kernel runs on moe_cuda_stream().
 *
 * Errors: ops return void (or a host value), so a failing CUDA/cuBLASLt call is logged at
 * once (file:line and the library's message) and the first one is kept as a sticky status
 * that the backend's sync() returns. */
#ifndef MOE_KERNELS_CUDA_COMMON_CUH
#define MOE_KERNELS_CUDA_COMMON_CUH

#include <type_traits>

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "util/status.h"
}
#include "kernels/backend.h"

/* extern "C" cuda_<op>, declared from the op itself so the lists cannot drift. */
#define MOE_CUDA_DECLARE(fn) extern "C" decltype(fn) cuda_##fn;
MOE_OPS_LIST(MOE_CUDA_DECLARE)
#undef MOE_CUDA_DECLARE

/* ---- state (backend_cuda.cu) --------------------------------------------------------- */

/* The backend's stream: every kernel, copy and memset of the backend runs on it. */
cudaStream_t moe_cuda_stream(void);
/* The priority of the backend's queue, which its GEMM lanes share (backend_cuda.cu). */
int moe_cuda_priority(void);
/* While the stream is the background queue: moe_cuda_stream() becomes a stream beside it
 * until moe_cuda_aside_end (1), for a small tail that should not hold the background's
 * next work; the step's join and the syncs wait for it. Else 0 and nothing changes. */
extern "C" int moe_cuda_aside_begin(void);
extern "C" void moe_cuda_aside_end(void);

/* Checks a CUDA result: on failure logs "file:line: what: message" and keeps the first
 * failure for sync(). Returns 1 when err is cudaSuccess. */
int moe_cuda_check_at(cudaError_t err, const char *file, int line, const char *what);
/* Records a failure that is not a cudaError_t (cuBLASLt, unsupported shape). */
void moe_cuda_fail_at(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Same for a cuBLASLt status. */
int moe_cuda_lt_check_at(cublasStatus_t st, const char *file, int line, const char *what);

#define MOE_CUDA_OK(call) moe_cuda_check_at((call), __FILE__, __LINE__, #call)
#define MOE_LT_OK(call) moe_cuda_lt_check_at((call), __FILE__, __LINE__, #call)
#define MOE_CUDA_FAIL(...) moe_cuda_fail_at(__FILE__, __LINE__, __VA_ARGS__)

/* The precision set for the GEMMs (matmul.cu). fp32 mode is the reference mode: its
 * elementwise exponentials run in double as the CPU reference does; the 16-bit modes use
 * float ones (GPUs for fp16, the T4, run double at 1/32 of float). */
extern "C" moe_precision cuda_gemm_precision(void);

/* Rounds n fp32 values into dst in that precision (bf16 or fp16; not in fp32 mode). */
extern "C" void cuda_round_operand(uint16_t *dst, const real *src, size_t n);

/* In a 16-bit precision, whether x (n elements) is a buffer marked as holding its GEMM
 * operand (backend.h mark_operand; *bf16 its format): its writers then write 16 bits. */
extern "C" int cuda_operand_in_place(const void *x, size_t n, int *bf16);

/* One float to its 16-bit pattern (bf16 or fp16), rounded to nearest even: the GEMMs'
 * operands (matmul.cu), the parameters' shadow (optim.cu), operands written in place. */
static __device__ __forceinline__ uint16_t moe_round16(float x, int bf16)
{
    return bf16 ? __bfloat16_as_ushort(__float2bfloat16(x)) : __half_as_ushort(__float2half(x));
}

/* Four of them as the 8 bytes of 4 consecutive 16-bit values (little-endian). */
static __device__ __forceinline__ uint2 moe_round16x4(float4 v, int bf16)
{
    return make_uint2(moe_round16(v.x, bf16) | (uint32_t)moe_round16(v.y, bf16) << 16,
                      moe_round16(v.z, bf16) | (uint32_t)moe_round16(v.w, bf16) << 16);
}

/* A 16-bit pattern (bf16 or fp16) as the float it holds: a marked buffer's value read. */
static __device__ __forceinline__ float moe_widen16(uint16_t v, int bf16)
{
    return bf16 ? __bfloat162float(__ushort_as_bfloat16(v)) : __half2float(__ushort_as_half(v));
}

/* Four of them from 8 bytes (the reverse of moe_round16x4). */
static __device__ __forceinline__ float4 moe_widen16x4(uint2 v, int bf16)
{
    return make_float4(
        moe_widen16((uint16_t)(v.x & 0xffffu), bf16), moe_widen16((uint16_t)(v.x >> 16), bf16),
        moe_widen16((uint16_t)(v.y & 0xffffu), bf16), moe_widen16((uint16_t)(v.y >> 16), bf16));
}

/* Element i of a buffer that holds fp32 values, or 16-bit ones (bf16 or fp16 by `bf16`)
 * when IN16: an input a GEMM may have written in 16 bits (backend.h mark_operand). */
template <int IN16>
static __device__ __forceinline__ float moe_ld(const void *p, size_t i, int bf16)
{
    if constexpr (IN16)
        return moe_widen16(((const uint16_t *)p)[i], bf16);
    else
        return ((const real *)p)[i];
}

/* Elements e .. e + 3 of such a buffer (e a multiple of 4; one float4, or 8 bytes). */
template <int IN16>
static __device__ __forceinline__ float4 moe_ld4(const void *p, size_t e, int bf16)
{
    if constexpr (IN16)
        return moe_widen16x4(((const uint2 *)p)[e / 4], bf16);
    else
        return ((const float4 *)p)[e / 4];
}

/* The backend's cuBLASLt handle and its persistent workspace (matmul.cu). */
cublasLtHandle_t moe_cuda_lt(void);
void *moe_cuda_workspace(size_t *nbytes);

/* Device scratch of at least nbytes, valid until the next call (one op at a time, in
 * stream order). Grows (after a stream synchronisation) when a call needs more; NULL on
 * failure (recorded). */
void *moe_cuda_scratch(size_t nbytes);
/* Pinned host scratch for results copied back; same rules. */
void *moe_cuda_host_scratch(size_t nbytes);
/* Copies nbytes of device memory to the pinned host scratch, waits, and returns it (NULL
 * on failure, recorded): how every op that returns a host value gets it. */
void *moe_cuda_fetch(const void *dev, size_t nbytes);
/* Queues a copy of nbytes of device memory into pinned host memory (from alloc_host)
 * without waiting (the table's queue_mark and queue_wait tell when it landed). */
void moe_cuda_fetch_async(void *host, const void *dev, size_t nbytes);

/* ---- launches ------------------------------------------------------------------------ */

#define MOE_CUDA_THREADS 256
#define MOE_CUDA_FULL_MASK 0xffffffffu

/* Is p 16-byte aligned (a float4 may be read there)? NULL is. */
static inline int moe_aligned16(const void *p) { return (uintptr_t)p % 16 == 0; }
static inline int moe_aligned8(const void *p) { return (uintptr_t)p % 8 == 0; }

/* Blocks for a grid-stride loop over n items (n > 0): enough to cover n, capped (the loop
 * covers the rest). */
static inline unsigned moe_cuda_blocks(size_t n, unsigned threads)
{
    size_t b = (n + threads - 1) / threads;
    const size_t cap = (size_t)1 << 20;
    return (unsigned)(b < 1 ? 1 : (b > cap ? cap : b));
}

/* ---- the kernel profile (backend's profile(): off unless asked) -------------------------
 * Brackets one piece of stream work (a kernel, a library call, a copy) with CUDA events
 * when the profile is on; `name` must be a string literal (its address is the key). */
extern int moe_cuda_profiling;
void moe_cuda_prof_begin(const char *name);
void moe_cuda_prof_end(void);
#define MOE_CUDA_PROF_BEGIN(name)                                                                  \
    do {                                                                                           \
        if (moe_cuda_profiling)                                                                    \
            moe_cuda_prof_begin(name);                                                             \
    } while (0)
#define MOE_CUDA_PROF_END()                                                                        \
    do {                                                                                           \
        if (moe_cuda_profiling)                                                                    \
            moe_cuda_prof_end();                                                                   \
    } while (0)

/* Launches kernel on the backend stream and checks the launch. */
#define MOE_CUDA_LAUNCH(kernel, grid, block, smem, ...)                                            \
    do {                                                                                           \
        MOE_CUDA_PROF_BEGIN(#kernel);                                                              \
        kernel<<<(grid), (block), (smem), moe_cuda_stream()>>>(__VA_ARGS__);                       \
        moe_cuda_check_at(cudaGetLastError(), __FILE__, __LINE__, "launch " #kernel);              \
        MOE_CUDA_PROF_END();                                                                       \
    } while (0)

/* The instantiation of a kernel templated on two run-time conditions: LAUNCH(X1 or X0,
 * Y1 or Y0) as a and b hold (LAUNCH a macro of two arguments around MOE_CUDA_LAUNCH). */
#define MOE_CUDA_PICK2(a, b, LAUNCH, X1, X0, Y1, Y0)                                               \
    do {                                                                                           \
        if ((a) && (b))                                                                            \
            LAUNCH(X1, Y1);                                                                        \
        else if (a)                                                                                \
            LAUNCH(X1, Y0);                                                                        \
        else if (b)                                                                                \
            LAUNCH(X0, Y1);                                                                        \
        else                                                                                       \
            LAUNCH(X0, Y0);                                                                        \
    } while (0)

/* The same for any number of run-time conditions, by type: f(moe_flag<a>(), moe_flag<b>(),
 * ...) for the values of a, b, ... (f a generic lambda whose body names its kernel's
 * instance by decltype(flag)::value). */
template <bool B> struct moe_flag {
    static constexpr bool value = B;
};
template <class F> static void moe_cuda_pick(F &&f) { f(); }
template <class F, class... Rest> static void moe_cuda_pick(F &&f, bool a, Rest... rest)
{
    if (a)
        moe_cuda_pick([&](auto... t) { f(moe_flag<true>(), t...); }, rest...);
    else
        moe_cuda_pick([&](auto... t) { f(moe_flag<false>(), t...); }, rest...);
}

#define MOE_CUDA_GRID_STRIDE(i, n)                                                                 \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)(n);                \
         i += (size_t)blockDim.x * gridDim.x)

/* ---- scratch carving ----------------------------------------------------------------- */

/* Two passes over the same takes: with base NULL it only sums the sizes; with base set it
 * hands out 256-byte aligned pointers. */
typedef struct {
    char *base;
    size_t used;
} moe_cuda_carve;

static inline void *moe_cuda_take(moe_cuda_carve *c, size_t nbytes)
{
    size_t at = (c->used + 255) & ~(size_t)255;
    c->used = at + (nbytes ? nbytes : 1);
    return c->base ? c->base + at : NULL;
}

#define MOE_CUDA_TAKE(c, type, count) ((type *)moe_cuda_take((c), sizeof(type) * (size_t)(count)))

/* Between the two passes: takes the scratch for what the first pass summed and rewinds.
 * Returns 0 (recorded) when the scratch cannot be had. */
static inline int moe_cuda_carve_alloc(moe_cuda_carve *c)
{
    c->base = (char *)moe_cuda_scratch(c->used);
    c->used = 0;
    return c->base != NULL;
}

/* ---- warp and block reductions ------------------------------------------------------- */

static __device__ __forceinline__ float moe_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(MOE_CUDA_FULL_MASK, v, o);
    return v;
}

static __device__ __forceinline__ double moe_warp_sum_d(double v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(MOE_CUDA_FULL_MASK, v, o);
    return v;
}

static __device__ __forceinline__ float moe_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(MOE_CUDA_FULL_MASK, v, o));
    return v;
}

/* Whether the environment variable name holds exactly value (the benchmark knobs). */
static inline int moe_cuda_env_is(const char *name, const char *value)
{
    const char *e = getenv(name);
    return e && strcmp(e, value) == 0;
}

/* V consecutive floats: V = 4 moves them as one float4 (the address 16-byte aligned),
 * V = 8 as two float4 (or 16 bytes of 16-bit values), V = 1 as one float (kernels
 * vectorized where their rows allow it, scalar elsewhere). */
template <int V> struct moe_fvec {
    float v[V];
};

/* V values from element `at` of a buffer of fp32 values, or 16-bit ones when IN16 (V = 4:
 * at % 4 == 0, one float4 or 8 bytes; V = 8: at % 8 == 0, 16-byte aligned, two float4 or
 * 16 bytes; moe_ld, moe_ld4). */
template <int V, int IN16>
static __device__ __forceinline__ moe_fvec<V> moe_ld_v(const void *p, size_t at, int bf16)
{
    moe_fvec<V> r;
    if constexpr (V == 8) { /* 16 bytes of 16-bit values, or two float4 */
        float4 t0, t1;
        if constexpr (IN16) {
            const uint4 u = ((const uint4 *)p)[at / 8];
            t0 = moe_widen16x4(make_uint2(u.x, u.y), bf16);
            t1 = moe_widen16x4(make_uint2(u.z, u.w), bf16);
        } else {
            t0 = ((const float4 *)p)[at / 4];
            t1 = ((const float4 *)p)[at / 4 + 1];
        }
        r.v[0] = t0.x, r.v[1] = t0.y, r.v[2] = t0.z, r.v[3] = t0.w;
        r.v[4] = t1.x, r.v[5] = t1.y, r.v[6] = t1.z, r.v[7] = t1.w;
    } else if constexpr (V == 4) {
        const float4 t = moe_ld4<IN16>(p, at, bf16);
        r.v[0] = t.x, r.v[1] = t.y, r.v[2] = t.z, r.v[3] = t.w;
    } else {
        r.v[0] = moe_ld<IN16>(p, at, bf16);
    }
    return r;
}

template <int V> static __device__ __forceinline__ moe_fvec<V> moe_load_v(const real *p)
{
    return moe_ld_v<V, 0>(p, 0, 0);
}

template <int V> static __device__ __forceinline__ void moe_store_v(real *p, const moe_fvec<V> &r)
{
    if constexpr (V == 8) {
        ((float4 *)p)[0] = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
        ((float4 *)p)[1] = make_float4(r.v[4], r.v[5], r.v[6], r.v[7]);
    } else if constexpr (V == 4) {
        *(float4 *)p = make_float4(r.v[0], r.v[1], r.v[2], r.v[3]);
    } else {
        *p = r.v[0];
    }
}

/* The same V values rounded to 16 bits (moe_round16) at p (8-byte aligned when V = 4,
 * 16-byte when V = 8):
 * the store of a writer whose output is marked as holding its GEMM operand. */
template <int V>
static __device__ __forceinline__ void moe_store16_v(uint16_t *p, const moe_fvec<V> &r, int bf16)
{
    if constexpr (V == 8) {
        const uint2 lo = moe_round16x4(make_float4(r.v[0], r.v[1], r.v[2], r.v[3]), bf16);
        const uint2 hi = moe_round16x4(make_float4(r.v[4], r.v[5], r.v[6], r.v[7]), bf16);
        *(uint4 *)p = make_uint4(lo.x, lo.y, hi.x, hi.y);
    } else if constexpr (V == 4) {
        *(uint2 *)p = moe_round16x4(make_float4(r.v[0], r.v[1], r.v[2], r.v[3]), bf16);
    } else {
        *p = moe_round16(r.v[0], bf16);
    }
}

/* Sum over a block of MOE_CUDA_THREADS threads in a fixed order (so the bits do not depend
 * on scheduling); every thread gets the result. Contains __syncthreads(). */
static __device__ __forceinline__ double moe_block_sum_d(double v)
{
    __shared__ double part[MOE_CUDA_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = moe_warp_sum_d(v);
    __syncthreads(); /* part may still be read by a previous call */
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    double s = 0.0;
    for (int w = 0; w < MOE_CUDA_THREADS / 32; w++)
        s += part[w];
    return s;
}

/* ---- scan and stable sort (bucket.cu) ------------------------------------------------ */

/* Exclusive prefix sum of n ints: out[0..n] (out[n] = total). out may be in. scratch:
 * moe_cuda_scan_ints(n) ints of device memory. */
size_t moe_cuda_scan_ints(int n);
void moe_cuda_scan(int *out, const int *in, int n, int *scratch);

/* Stable grouping of items 0..n-1 by an int key: order lists the items by key, items of
 * one key in increasing index.
 *   V > 0: keys are in [0, V); an item whose key is outside (negative: "none") is left
 *          out; start (V+1) gives each key's range in order, start[V] the items kept.
 *   V = 0: any non-negative key (LSD radix sort, 4 passes of 8 bits, or 2 for keys below
 *   2^16: moe_cuda_sort_limit); start is NULL.
 * Buffers come from a carve: moe_cuda_sort_take sizes/hands them out (call it in both
 * passes of the carve), moe_cuda_sort_run sorts. */
typedef struct {
    int n, V, tiles, tile;
    int passes; /* 1 when V > 0; radix passes (4, or fewer: moe_cuda_sort_limit) */
    int *order; /* (n) the result */
    int *start; /* (V+1) when V > 0 */
    int *tmp;   /* (n) radix ping-pong */
    int *cnt;   /* (tiles, buckets) per-tile counts, then per-tile bases */
    int *total; /* (buckets) */
    int *bstart;
    int *scan; /* scan scratch */
} moe_cuda_sort;

void moe_cuda_sort_take(moe_cuda_sort *s, moe_cuda_carve *c, int n, int V);
/* A V = 0 sort's keys are below limit (> 0; 0: any): the radix passes its bits need (an
 * even number, at least 2). */
void moe_cuda_sort_limit(moe_cuda_sort *s, int limit);

/* route.cu: the embedding's backward (dtable[token] += dout rows in order; tokens < V). */
void moe_cuda_embedding_grad(real *dtable, const real *dout, const int32_t *tokens, int N, int D,
                             int V);
void moe_cuda_sort_run(const moe_cuda_sort *s, const int32_t *keys);

/* Accumulation over the runs of equal keys of a sorted order (V = 0 sort): for every run
 * (key) and column j < W, one thread computes
 *     v = op.load(key, j); v += op.value(item, j) for the run's items in order; op.store
 * in float with round-to-nearest adds (no contraction), i.e. exactly the sequential loop
 * "for item in order: dst[key][j] += value(item, j)" of the CPU reference. Deterministic,
 * no atomics. V = 4: a thread takes 4 columns by the op's float4 forms (load4, value4,
 * store4; the caller checked W and the pointers), the same additions per column. The run
 * is walked MOE_RUNS_AHEAD items at a time, their values loaded before any is added (a
 * run's items are contiguous in the order, so an item of another key ends it): a token
 * that recurs hundreds of times in a batch (the synthetic corpus's motifs) made its
 * thread wait one load latency per item. Where the op says any item's value may be read
 * (any_item = true: the embedding's backward), the values of every item of the group are
 * loaded before its keys are compared, so a group waits for two loads (order, then
 * keys and values), not three (the embedding's backward at the bench shape: 176 -> 106 us
 * on an H200; 16 or 32 items at a time were slower: 253, 356 us). */
template <class Op, class = void> struct moe_any_item : std::false_type {
};
template <class Op>
struct moe_any_item<Op, std::void_t<decltype(Op::any_item)>>
    : std::integral_constant<bool, Op::any_item> {
};

#define MOE_RUNS_AHEAD 8
template <class Op, int V>
__global__ void moe_runs_kernel(Op op, const int *order, const int32_t *keys, int n, int W)
{
    typedef typename std::conditional<V == 4, float4, float>::type vec;
    const int G = W / V;
    MOE_CUDA_GRID_STRIDE(e, (size_t)n * G)
    {
        const int p = (int)(e / G), j = (int)(e % G) * V;
        const int key = keys[order[p]];
        if (p > 0 && keys[order[p - 1]] == key)
            continue; /* not the head of its run */
        vec v;
        if constexpr (V == 4)
            v = op.load4(key, j);
        else
            v = op.load(key, j);
        for (int q = p, more = 1; more; q += MOE_RUNS_AHEAD) {
            int item[MOE_RUNS_AHEAD];
            bool in[MOE_RUNS_AHEAD];
            vec a[MOE_RUNS_AHEAD];
#pragma unroll
            for (int u = 0; u < MOE_RUNS_AHEAD; u++) {
                item[u] = q + u < n ? order[q + u] : 0;
                in[u] = q + u < n && keys[item[u]] == key;
            }
#pragma unroll
            for (int u = 0; u < MOE_RUNS_AHEAD; u++)
                if (moe_any_item<Op>::value ? q + u < n : in[u]) {
                    if constexpr (V == 4)
                        a[u] = op.value4(item[u], j);
                    else
                        a[u] = op.value(item[u], j);
                }
#pragma unroll
            for (int u = 0; u < MOE_RUNS_AHEAD; u++)
                if (in[u]) {
                    if constexpr (V == 4)
                        v = make_float4(__fadd_rn(v.x, a[u].x), __fadd_rn(v.y, a[u].y),
                                        __fadd_rn(v.z, a[u].z), __fadd_rn(v.w, a[u].w));
                    else
                        v = __fadd_rn(v, a[u]);
                }
            more = in[MOE_RUNS_AHEAD - 1];
        }
        if constexpr (V == 4)
            op.store4(key, j, v);
        else
            op.store(key, j, v);
    }
}

/* dx (n, D) = base (0 where NULL), nothing where base is dx: the start of the sums below
 * where the runs store only the tokens with rows. */
static inline void moe_cuda_rows_base(real *dx, const real *base, int n, int D)
{
    if (base == dx || n <= 0 || D <= 0)
        return;
    const size_t bytes = sizeof(real) * (size_t)n * D;
    if (base)
        MOE_CUDA_OK(cudaMemcpyAsync(dx, base, bytes, cudaMemcpyDeviceToDevice, moe_cuda_stream()));
    else
        MOE_CUDA_OK(cudaMemsetAsync(dx, 0, bytes, moe_cuda_stream()));
}

/* A start value of those sums: base[i], or 0 where base is NULL. */
static __device__ __forceinline__ float moe_base_value(const real *base, size_t i)
{
    return base ? base[i] : 0.f;
}

static __device__ __forceinline__ float4 moe_base_value4(const real *base, size_t i)
{
    return base ? *(const float4 *)(base + i) : make_float4(0.f, 0.f, 0.f, 0.f);
}

/* Sorts items 0..n-1 by keys (non-negative) and runs op over every (run, column < W): 4
 * columns a thread where the op has its float4 forms and W and its pointers allow. */
template <class Op>
static void moe_cuda_runs(const Op &op, const int32_t *keys, int n, int W, int key_limit = 0)
{
    if (n <= 0 || W <= 0)
        return;
    moe_cuda_sort s;
    moe_cuda_carve c = {NULL, 0};
    moe_cuda_sort_take(&s, &c, n, 0);
    if (!moe_cuda_carve_alloc(&c))
        return;
    moe_cuda_sort_take(&s, &c, n, 0);
    moe_cuda_sort_limit(&s, key_limit);
    moe_cuda_sort_run(&s, keys);
    if constexpr (Op::vec4)
        if (W % 4 == 0 && op.aligned16()) {
            MOE_CUDA_LAUNCH((moe_runs_kernel<Op, 4>),
                            moe_cuda_blocks((size_t)n * (W / 4), MOE_CUDA_THREADS),
                            MOE_CUDA_THREADS, 0, op, s.order, keys, n, W);
            return;
        }
    MOE_CUDA_LAUNCH((moe_runs_kernel<Op, 1>), moe_cuda_blocks((size_t)n * W, MOE_CUDA_THREADS),
                    MOE_CUDA_THREADS, 0, op, s.order, keys, n, W);
}

/* With the inverse map slot_row (N, K): the row of each (token, slot) or -1. Per (token,
 * group of V columns) one thread takes the token's rows, sorts them (at most K), and adds
 * them in row order onto the loaded values: the additions of moe_runs_kernel, without
 * sorting all rows by token. V = 4 takes an op's float4 forms (load4, value4, store4: ops
 * with vec4 = true, columns and pointers the caller checked), V = 2 its float2 forms
 * (load2, value2, store2: ops with vec2 = true); the additions per column are the same.
 * K2: K is 2 (top-2), the two rows ordered by one comparison in registers and a
 * negative one skipped where it is added (the general form's insertion sort indexes its
 * array at run time, which puts it in local memory); the same additions in the same
 * order. Ops with weighted = true scale each row by a factor of its (token, slot) that
 * op.weight(n, k) reads: loaded here next to slot_row (no load waits on the row number
 * for it) and given to the op's valuew / value4w (the value of value / value4, which
 * look the factor up through the row for moe_runs_kernel). */
#define MOE_GATHER_MAX_K 16
template <class Op, int V, bool K2>
static __global__ void moe_gather_rows_kernel(Op op, const int32_t *slot_row, int N, int K, int W)
{
    const int G = W / V;
    MOE_CUDA_GRID_STRIDE(e, (size_t)N * G)
    {
        const int n = (int)(e / G), j = (int)(e % G) * V;
        constexpr int RM = K2 ? 2 : MOE_GATHER_MAX_K;
        int rows[RM], c = 0;
        float wt[RM]; /* weighted ops: each row's factor */
        if constexpr (K2) {
            const int a = slot_row[(size_t)n * 2], b = slot_row[(size_t)n * 2 + 1];
            rows[0] = min(a, b); /* ascending; -1 (no row) first, skipped below */
            rows[1] = max(a, b);
            if constexpr (Op::weighted) {
                const float wa = op.weight(n, 0), wb = op.weight(n, 1);
                wt[0] = a <= b ? wa : wb;
                wt[1] = a <= b ? wb : wa;
            }
            c = 2;
        } else {
            for (int k = 0; k < K; k++) {
                const int r = slot_row[(size_t)n * K + k];
                if (r < 0)
                    continue;
                float f = 1.f;
                if constexpr (Op::weighted)
                    f = op.weight(n, k);
                int i = c++;
                for (; i > 0 && rows[i - 1] > r; i--) { /* insertion: ascending rows */
                    rows[i] = rows[i - 1];
                    wt[i] = wt[i - 1];
                }
                rows[i] = r;
                wt[i] = f;
            }
        }
        /* every token stored: one without rows gets its base value */
        if constexpr (V == 4) {
            float4 v = op.load4(n, j);
#pragma unroll
            for (int i = 0; i < RM; i++) {
                if (i >= c)
                    break;
                if (K2 && rows[i] < 0)
                    continue;
                float4 a;
                if constexpr (Op::weighted)
                    a = op.value4w(rows[i], j, wt[i]);
                else
                    a = op.value4(rows[i], j);
                v = make_float4(__fadd_rn(v.x, a.x), __fadd_rn(v.y, a.y), __fadd_rn(v.z, a.z),
                                __fadd_rn(v.w, a.w));
            }
            op.store4(n, j, v);
        } else if constexpr (V == 2) {
            float2 v = op.load2(n, j);
#pragma unroll
            for (int i = 0; i < RM; i++) {
                if (i >= c)
                    break;
                if (K2 && rows[i] < 0)
                    continue;
                const float2 a = op.value2(rows[i], j);
                v = make_float2(__fadd_rn(v.x, a.x), __fadd_rn(v.y, a.y));
            }
            op.store2(n, j, v);
        } else {
            float v = op.load(n, j);
#pragma unroll
            for (int i = 0; i < RM; i++) {
                if (i >= c)
                    break;
                if (K2 && rows[i] < 0)
                    continue;
                float a;
                if constexpr (Op::weighted)
                    a = op.valuew(rows[i], j, wt[i]);
                else
                    a = op.value(rows[i], j);
                v = __fadd_rn(v, a);
            }
            op.store(n, j, v);
        }
    }
}

/* Whether moe_cuda_token_sums gathers through slot_row (storing every token once) rather
 * than sorting the rows (storing only tokens that have rows). */
static inline bool moe_cuda_token_sums_gather(const int32_t *slot_row, int K)
{
    return slot_row && K <= MOE_GATHER_MAX_K;
}

/* The token sums of op over the M rows of tokens row_token (columns < W), onto the op's
 * start values (load: its base, 0, or the destination itself): by gathering through
 * slot_row (N, K) when given (every token stored), else by sorting the rows (the
 * destination first set to the start values by op.start(N): the runs store only tokens
 * with rows). */
template <class Op>
static void moe_cuda_token_sums(const Op &op, const int32_t *row_token, int M, int W,
                                const int32_t *slot_row, int N, int K)
{
    if (moe_cuda_token_sums_gather(slot_row, K)) {
        if (N <= 0 || W <= 0)
            return;
        moe_cuda_pick(
            [&](auto k2) {
                constexpr bool K2 = decltype(k2)::value;
                if constexpr (Op::vec4)
                    if (W % 4 == 0 && op.aligned16()) {
                        MOE_CUDA_LAUNCH((moe_gather_rows_kernel<Op, 4, K2>),
                                        moe_cuda_blocks((size_t)N * (W / 4), MOE_CUDA_THREADS),
                                        MOE_CUDA_THREADS, 0, op, slot_row, N, K, W);
                        return;
                    }
                if constexpr (Op::vec2)
                    if (W % 2 == 0 && op.aligned8()) {
                        MOE_CUDA_LAUNCH((moe_gather_rows_kernel<Op, 2, K2>),
                                        moe_cuda_blocks((size_t)N * (W / 2), MOE_CUDA_THREADS),
                                        MOE_CUDA_THREADS, 0, op, slot_row, N, K, W);
                        return;
                    }
                MOE_CUDA_LAUNCH((moe_gather_rows_kernel<Op, 1, K2>),
                                moe_cuda_blocks((size_t)N * W, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                                0, op, slot_row, N, K, W);
            },
            K == 2);
        return;
    }
    op.start(N);
    moe_cuda_runs(op, row_token, M, W);
}

#endif
