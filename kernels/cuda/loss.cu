/* kernels/cuda/loss.cu: token cross-entropy (lse of the logits minus the target's logit)
 * and its backward.
 *
 * Forward: one block of CE_THREADS per row, which reads the row once: each thread keeps a
 * running max m (float) and the sum s of exp(x - m) (double in fp32 mode, as the CPU
 * reference; float in the 16-bit modes, whose logits carry 8 or 11 bits), rescaled when
 * m grows; the threads' (m, s) are then merged in a fixed order (warp butterfly, then the
 * warps in order), so the bits do not depend on scheduling. Fused (cross_entropy_fused): one block
 * does a row's forward and then its backward, from the values its threads kept in
 * registers (a row of the bench's 32768 16-bit logits is read from memory once). Backward:
 * overwrites dlogits (which may be the logits: each value is read, then written, by one thread); a
 * 2D grid (x: the row, y: the row's columns), so no thread divides to find its row; a separate
 * dlogits marked as a GEMM operand gets 16-bit values (no rounding pass before the LM head's
 * GEMMs). Both load float4 when V % 4 == 0 and the rows are 16-byte aligned, floats otherwise.
 * Logits marked as 16-bit (the LM head's GEMM wrote them so, backend.h mark_operand) are
 * read as 16 bits (L16: 8 bytes for 4 values, 2 for one), except in place (dlogits =
 * logits), where the buffer is taken as fp32 both ways.
 *
 * The exponentials are in double in fp32 mode (as the CPU reference), in float in the
 * 16-bit modes, where they are the fast exponential: exp(x - c) as ex2.approx of
 * fma(x, log2(e), -c log2(e)) (ce_exp_sub; a few 1e-6 relative for the arguments here,
 * x - max >= about -40), the rescalings of the running sum __expf. The fused pass is
 * bound by instruction issue (Nsight Compute on an H200), so each instruction a logit
 * counts. */
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"

/* exp(x) in F: double's in fp32 mode, the fast float exponential otherwise (0 at -inf). */
template <typename F> static __device__ __forceinline__ F ce_expf(F x)
{
    if constexpr (sizeof(F) == sizeof(float))
        return __expf(x);
    else
        return exp(x);
}

/* exp(x - c) in F, given c2 = c log2(e) (ce_log2e): in float one fused multiply-add and
 * the base-2 exponential (x log2(e) exact inside the fma, then c2 subtracted: about 3e-6
 * relative for the logits here, as __expf of x - c), in double exp(x - c). A -inf x gives
 * 0. The forward's sums and the backward's values both take this form (the fused kernel
 * and the two kernels keep the same bits). */
#define CE_LOG2E 1.4426950408889634
template <typename F> static __device__ __forceinline__ F ce_log2e(F c)
{
    return sizeof(F) == sizeof(float) ? c * (F)CE_LOG2E : c;
}

template <typename F> static __device__ __forceinline__ F ce_exp_sub(F x, F c, F c2)
{
    if constexpr (sizeof(F) == sizeof(float)) {
        float y;
        asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, (float)CE_LOG2E, -c2)));
        return y;
    } else {
        return exp(x - c);
    }
}

/* exp(x - m) in F; a -inf value adds nothing (also when m is still -inf). */
template <typename F> static __device__ __forceinline__ F ce_exp(float x, float m)
{
    return x == -INFINITY ? (F)0 : ce_exp_sub<F>((F)x, (F)m, ce_log2e<F>((F)m));
}

/* Raises the running max m to x when x is larger, rescaling the sum s to the new max. */
template <typename F> static __device__ __forceinline__ void ce_raise(float &m, F &s, float x)
{
    if (x > m) {
        s *= ce_expf<F>((F)m - (F)x); /* 0 while m is -inf (s is 0 then too) */
        m = x;
    }
}

/* (m, s) becomes the max and sum of both (m, s) and (m2, s2). */
template <typename F>
static __device__ __forceinline__ void ce_merge(float &m, F &s, float m2, F s2)
{
    const float mx = fmaxf(m, m2);
    if (mx == -INFINITY)
        return; /* neither has seen a value (or only -inf): s and s2 are 0 */
    s = s * ce_expf<F>((F)m - (F)mx) + s2 * ce_expf<F>((F)m2 - (F)mx);
    m = mx;
}

/* Threads of the kernels that take one row a block (forward, fused). */
#define CE_THREADS 512

/* Merges the (m, s) of a block of CE_THREADS threads in a fixed order; thread 0 gets
 * the result. Called once per kernel (its shared arrays are not guarded for reuse). */
template <typename F> static __device__ void ce_block_merge(float &m, F &s)
{
    __shared__ float part_m[CE_THREADS / 32];
    __shared__ F part_s[CE_THREADS / 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(MOE_CUDA_FULL_MASK, m, o);
        const F s2 = __shfl_xor_sync(MOE_CUDA_FULL_MASK, s, o);
        ce_merge<F>(m, s, m2, s2);
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_s[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        m = part_m[0];
        s = part_s[0];
        for (int w = 1; w < CE_THREADS / 32; w++)
            ce_merge<F>(m, s, part_m[w], part_s[w]);
    }
}

/* A group of 4 logits as loaded: 8 bytes of 16-bit values (L16) or a float4. The fused
 * kernel keeps its first CE_KEPT(L16) groups a thread in registers between its passes
 * (a row of up to 16 x 4 x 512 = 32768 16-bit logits, 4 x 4 x 512 fp32 ones, is read
 * from memory once; a second pass over a row from L2 missed there when many rows were in
 * flight). */
template <bool L16> using ce_group = typename std::conditional<L16, uint2, float4>::type;
#define CE_KEPT(L16) ((L16) ? 16 : 4)

template <bool L16>
static __device__ __forceinline__ ce_group<L16> ce_load(const real *logits, size_t e)
{
    if constexpr (L16)
        return ((const uint2 *)logits)[e / 4];
    else
        return ((const float4 *)logits)[e / 4];
}

template <bool L16> static __device__ __forceinline__ float4 ce_widen(ce_group<L16> x, int bf16)
{
    if constexpr (L16)
        return moe_widen16x4(x, bf16);
    else
        return x;
}

/* Adds a group of 4 logits to the running (m, s): the values of ce_exp, with its test for
 * -inf once a group. After the raise m >= every value of the group, so m is -inf only
 * where all four are; 0 stands for it then (exp(-inf - 0) = 0, no -inf - -inf), and a -inf
 * value under a finite m gives exp(-inf) = 0, as ce_exp's test does. */
template <typename F> static __device__ __forceinline__ void ce_add4(float &m, F &s, float4 x)
{
    ce_raise<F>(m, s, fmaxf(fmaxf(x.x, x.y), fmaxf(x.z, x.w)));
    const F mf = m == -INFINITY ? (F)0 : (F)m, mf2 = ce_log2e<F>(mf);
    s += ce_exp_sub<F>((F)x.x, mf, mf2);
    s += ce_exp_sub<F>((F)x.y, mf, mf2);
    s += ce_exp_sub<F>((F)x.z, mf, mf2);
    s += ce_exp_sub<F>((F)x.w, mf, mf2);
}

/* One row of the forward (block n = blockIdx.x, CE_THREADS threads); V4: the row is read
 * in groups of 4, thread t taking groups t, t + CE_THREADS, ... in that order. KEEP: the
 * first KEEP groups of the thread are loaded into kept[] first, all at once (the fused
 * kernel's second pass reads them there); the order of the sums is the same either way,
 * so the fused kernel's lse has the forward kernel's bits. */
template <typename F, bool V4, bool L16, int KEEP>
static __device__ __forceinline__ double
ce_forward_row(real *losses, real *lse, const real *logits, const int32_t *targets, int V, int bf16,
               ce_group<L16> *kept, float *target_out = NULL)
{
    const int n = blockIdx.x;
    const size_t row = (size_t)n * V;
    float m = -INFINITY;
    F s = 0;
    float target_logit = 0.0f; /* thread 0 loads it with the row, not after the merge */
    if (threadIdx.x == 0)
        target_logit = moe_ld<L16>(logits, row + targets[n], bf16);
    if (V4) {
        const int groups = V / 4;
#pragma unroll
        for (int k = 0; k < KEEP; k++) {
            const int c = threadIdx.x + k * CE_THREADS;
            if (c < groups)
                kept[k] = ce_load<L16>(logits, row + 4 * (size_t)c);
        }
#pragma unroll
        for (int k = 0; k < KEEP; k++)
            if (threadIdx.x + k * CE_THREADS < groups)
                ce_add4<F>(m, s, ce_widen<L16>(kept[k], bf16));
#pragma unroll 4 /* several loads in flight per thread */
        for (int c = threadIdx.x + KEEP * CE_THREADS; c < groups; c += CE_THREADS)
            ce_add4<F>(m, s, moe_ld4<L16>(logits, row + 4 * (size_t)c, bf16));
    } else {
        for (int v = threadIdx.x; v < V; v += blockDim.x) {
            const float x = moe_ld<L16>(logits, row + v, bf16);
            ce_raise<F>(m, s, x);
            s += ce_exp<F>(x, m);
        }
    }
    ce_block_merge<F>(m, s);
    double r = 0.0; /* thread 0: the row's lse, returned */
    if (threadIdx.x == 0) {
        r = (double)m + log((double)s);
        lse[n] = (real)r;
        losses[n] = (real)(r - target_logit);
        if (target_out)
            *target_out = target_logit;
    }
    return r;
}

template <typename F, bool V4, bool L16>
static __global__ void __launch_bounds__(CE_THREADS)
    cross_entropy_forward_kernel(real *losses, real *lse, const real *logits,
                                 const int32_t *targets, int V, int bf16)
{
    ce_forward_row<F, V4, L16, 0>(losses, lse, logits, targets, V, bf16, NULL);
}

/* Whether the logits (n) are marked as 16-bit (*bf16 their format). */
static int logits16(const real *logits, size_t n, int *bf16)
{
    return cuda_operand_in_place(logits, n, bf16);
}

extern "C" void cuda_cross_entropy_forward(real *losses, real *lse, const real *logits,
                                           const int32_t *targets, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    const int v4 = V % 4 == 0 && moe_aligned16(logits);
    int bf16 = 0;
    const int l16 = logits16(logits, (size_t)N * V, &bf16);
#define CE_FORWARD(F, V4, L16)                                                                     \
    MOE_CUDA_LAUNCH((cross_entropy_forward_kernel<F, V4, L16>), N, CE_THREADS, 0, losses, lse,     \
                    logits, targets, V, bf16)
#define CE_FORWARD_FLOAT(V4, L16) CE_FORWARD(float, V4, L16)
    if (cuda_gemm_precision() == MOE_PREC_FP32) { /* never l16 */
        if (v4)
            CE_FORWARD(double, true, false);
        else
            CE_FORWARD(double, false, false);
    } else {
        MOE_CUDA_PICK2(v4, l16, CE_FORWARD_FLOAT, true, false, true, false);
    }
#undef CE_FORWARD_FLOAT
#undef CE_FORWARD
}

/* dloss * (exp(x - s) - hit) for one logit x of a row of lse s. */
template <typename F>
static __device__ __forceinline__ real ce_grad(real x, F s, int hit, real dloss)
{
    return (real)(dloss * (ce_exp_sub<F>((F)x, s, ce_log2e<F>(s)) - (F)hit));
}

/* dlogits = dloss * (exp(logit - s) - onehot(t)) over the columns first, first + stride, ...
 * of row n (float4 groups when V4). No __restrict__: dlogits may be logits. O16: dlogits
 * is a buffer marked as holding its GEMM operand (never the logits themselves), written
 * in 16 bits (bf16 or fp16 by `bf16`) as the GEMM would round the fp32 value. */
template <typename F, bool O16>
static __device__ __forceinline__ void ce_backward_group(real *dlogits, size_t row, int c, float4 x,
                                                         F s, real dloss, int bf16)
{
    const float4 d = make_float4(ce_grad<F>(x.x, s, 0, dloss), ce_grad<F>(x.y, s, 0, dloss),
                                 ce_grad<F>(x.z, s, 0, dloss), ce_grad<F>(x.w, s, 0, dloss));
    if (O16)
        ((uint2 *)dlogits)[row / 4 + c] = moe_round16x4(d, bf16);
    else
        ((float4 *)(dlogits + row))[c] = d;
}

/* The same over the columns first, first + stride, ... of row n; KEEP: the first KEEP
 * groups come from kept[] (ce_forward_row loaded them), the rest from memory. V4: the
 * groups are written without the target's hit, and the thread whose group holds the
 * target t writes that one value again, with it (its logit read before any store: in
 * place the group's store overwrites it), instead of testing every group for t. */
template <typename F, bool V4, bool O16, bool L16, int KEEP>
static __device__ __forceinline__ void
ce_backward_cols(real *dlogits, const real *logits, int n, F s, int t, real dloss, int V, int bf16,
                 int first, int stride, const ce_group<L16> *kept, const float *xt_shared = NULL)
{
    const size_t row = (size_t)n * V;
    if (V4) {
        /* whether this thread's groups hold the target */
        auto owner = [&]() {
            const int tg = t >> 2;
            return t >= 0 && t < V && tg >= first && (tg - first) % stride == 0;
        };
        /* the target's logit: the fused kernel has it in shared memory (read after the
         * loops: no register held through them), else read before any store */
        float xt = !xt_shared && owner() ? moe_ld<L16>(logits, row + t, bf16) : 0.0f;
#pragma unroll
        for (int k = 0; k < KEEP; k++)
            if (first + k * stride < V / 4)
                ce_backward_group<F, O16>(dlogits, row, first + k * stride,
                                          ce_widen<L16>(kept[k], bf16), s, dloss, bf16);
#pragma unroll 4
        for (int c = first + KEEP * stride; c < V / 4; c += stride)
            ce_backward_group<F, O16>(
                dlogits, row, c, moe_ld4<L16>(logits, row + 4 * (size_t)c, bf16), s, dloss, bf16);
        if (owner()) {
            if (xt_shared)
                xt = *xt_shared;
            const real dt = ce_grad<F>(xt, s, 1, dloss);
            if (O16)
                ((uint16_t *)dlogits)[row + t] = moe_round16(dt, bf16);
            else
                dlogits[row + t] = dt;
        }
    } else {
        for (int v = first; v < V; v += stride) {
            const real d = ce_grad<F>(moe_ld<L16>(logits, row + v, bf16), s, v == t, dloss);
            if (O16)
                ((uint16_t *)dlogits)[row + v] = moe_round16(d, bf16);
            else
                dlogits[row + v] = d;
        }
    }
}

/* The backward of one row (blockIdx.x), softmax from the saved lse; the row's columns
 * spread over the blocks of blockIdx.y. */
template <typename F, bool V4, bool O16, bool L16>
static __global__ void cross_entropy_backward_kernel(real *dlogits, const real *logits,
                                                     const real *lse, const int32_t *targets,
                                                     real dloss, int V, int bf16)
{
    const int n = blockIdx.x;
    ce_backward_cols<F, V4, O16, L16, 0>(dlogits, logits, n, (F)lse[n], targets[n], dloss, V, bf16,
                                         blockIdx.y * blockDim.x + threadIdx.x,
                                         gridDim.y * blockDim.x, NULL);
}

/* Forward, then backward, of one row in one block (the fused LM head): the backward takes
 * the lse as stored (so the bits are the two kernels'), and the groups of the row each
 * thread kept in registers (V4: all of a row of up to 32768 16-bit logits), the rest
 * read again (from L2 where it still is). */
template <typename F, bool V4, bool O16, bool L16, bool BF>
static __global__ void __launch_bounds__(CE_THREADS)
    cross_entropy_fused_kernel(real *losses, real *lse, real *dlogits, const real *logits,
                               const int32_t *targets, real dloss, int V, int bf16_arg)
{
    /* the 16-bit format as a constant where 16-bit values are read or written (BF: bf16,
     * else fp16), so the widening and rounding compile to one form, not both and a select */
    const int bf16 = O16 || L16 ? (int)BF : bf16_arg;
    __shared__ real row_lse;
    __shared__ float row_target; /* the target's logit, for the thread whose group holds it */
    constexpr int KEEP = V4 ? CE_KEPT(L16) : 0;
    ce_group<L16> kept[KEEP > 0 ? KEEP : 1];
    const int n = blockIdx.x;
    const int t = targets[n]; /* loaded with the row */
    const double r =
        ce_forward_row<F, V4, L16, KEEP>(losses, lse, logits, targets, V, bf16, kept, &row_target);
    if (threadIdx.x == 0)
        row_lse = (real)r; /* the lse as stored, without reading it back */
    __syncthreads();
    ce_backward_cols<F, V4, O16, L16, KEEP>(dlogits, logits, n, (F)row_lse, t, dloss, V, bf16,
                                            threadIdx.x, CE_THREADS, kept, &row_target);
}

/* The instance a launcher runs, as a type: F the sums' type, V4 (rows read as float4),
 * O16 (16-bit gradients written), L16 (16-bit logits read). */
template <typename F_, bool V4_, bool O16_, bool L16_, bool BF_ = false> struct ce_kind {
    typedef F_ F;
    static constexpr bool V4 = V4_, O16 = O16_, L16 = L16_, BF = BF_;
};

template <bool V4, bool O16, typename Launch>
static void ce_pick_l16(int l16, int bf16, Launch &launch)
{
    if (l16 && bf16)
        launch(ce_kind<float, V4, O16, true, true>());
    else if (l16)
        launch(ce_kind<float, V4, O16, true, false>());
    else if (O16 && bf16)
        launch(ce_kind<float, V4, O16, false, true>());
    else
        launch(ce_kind<float, V4, O16, false, false>());
}

/* launch(ce_kind<...>()) for the flags: sums in double in fp32 (where no buffer is
 * marked, so never o16 or l16), in float in the 16-bit precisions; BF: the 16-bit
 * format (bf16, else fp16) where o16 or l16. */
template <typename Launch> static void ce_pick(int v4, int o16, int l16, int bf16, Launch launch)
{
    if (cuda_gemm_precision() == MOE_PREC_FP32) {
        if (v4)
            launch(ce_kind<double, true, false, false>());
        else
            launch(ce_kind<double, false, false, false>());
    } else if (v4 && o16) {
        ce_pick_l16<true, true>(l16, bf16, launch);
    } else if (v4) {
        ce_pick_l16<true, false>(l16, bf16, launch);
    } else if (o16) {
        ce_pick_l16<false, true>(l16, bf16, launch);
    } else {
        ce_pick_l16<false, false>(l16, bf16, launch);
    }
}

extern "C" void cuda_cross_entropy_backward(real *dlogits, const real *logits, const real *lse,
                                            const int32_t *targets, real dloss, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    int bf16 = 0; /* in place (dlogits = logits) the 16-bit writes would overtake the reads */
    const int o16 = dlogits != logits && cuda_operand_in_place(dlogits, (size_t)N * V, &bf16);
    /* in place the buffer holds fp32 logits and gets fp32 gradients, marked or not */
    const int l16 = dlogits != logits && logits16(logits, (size_t)N * V, &bf16);
    const int v4 = V % 4 == 0 && moe_aligned16(logits) && moe_aligned16(dlogits);
    const int cols = v4 ? V / 4 : V; /* items per row */
    const unsigned per_row = (unsigned)((cols + MOE_CUDA_THREADS - 1) / MOE_CUDA_THREADS);
    const dim3 grid((unsigned)N, per_row < 65535 ? per_row : 65535); /* grid.y <= 65535 */
    ce_pick(
        v4, o16, l16, 0,
        [&](auto kind) { /* BF not used: the format stays a parameter */
                         typedef decltype(kind) K;
                         MOE_CUDA_LAUNCH(
                             (cross_entropy_backward_kernel<typename K::F, K::V4, K::O16, K::L16>),
                             grid, MOE_CUDA_THREADS, 0, dlogits, logits, lse, targets, dloss, V,
                             bf16);
        });
}

extern "C" void cuda_cross_entropy_fused(real *losses, real *lse, real *dlogits, const real *logits,
                                         const int32_t *targets, real dloss, int N, int V)
{
    if (N <= 0 || V <= 0)
        return;
    if (dlogits == logits) { /* the op's contract: the rows are read twice */
        MOE_CUDA_FAIL("cross_entropy_fused: dlogits must not be the logits");
        return;
    }
    const int v4 = V % 4 == 0 && moe_aligned16(logits) && moe_aligned16(dlogits);
    if (!v4 && V % 4 == 0 && moe_aligned16(logits)) { /* the forward alone would take float4 */
        cuda_cross_entropy_forward(losses, lse, logits, targets, N, V); /* (its sum order) */
        cuda_cross_entropy_backward(dlogits, logits, lse, targets, dloss, N, V);
        return;
    }
    int bf16 = 0;
    const int o16 = cuda_operand_in_place(dlogits, (size_t)N * V, &bf16);
    const int l16 = logits16(logits, (size_t)N * V, &bf16);
    ce_pick(v4, o16, l16, bf16, [&](auto kind) {
        typedef decltype(kind) K;
        MOE_CUDA_LAUNCH((cross_entropy_fused_kernel<typename K::F, K::V4, K::O16, K::L16, K::BF>),
                        N, CE_THREADS, 0, losses, lse, dlogits, logits, targets, dloss, V, bf16);
    });
}
