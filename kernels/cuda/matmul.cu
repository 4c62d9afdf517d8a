/* kernels/cuda/matmul.cu: the linear layer and the grouped linear of the experts on
 * cuBLASLt, fp32 in and out with CUBLAS_COMPUTE_32F (true fp32 products, no TF32).
 *
 * Row-major (r, c) is column-major (c, r), so out (N,O) = x W^T is, column-major,
 * out^T (O,N) = W^T(stored I x O, transposed) x^T (I,N). Forward writes (beta 0); the
 * backward accumulates (beta 1), as ops.h says. The algorithm of each shape (sizes,
 * transposes, leading dimensions, pointer alignments, beta) comes from
 * cublasLtMatmulAlgoGetHeuristic once and is cached with its descriptors in a small
 * open-addressing table (flushed when 3/4 full): the fastest of the heuristic's first
 * TUNE_ALGOS candidates that give the first's bits, timed once on random operands of the
 * shape (plan_tune; the first where none is clearly faster, or with MOE_GEMM_TUNE=0).
 * All GEMMs share the backend's persistent workspace on its one stream. Grouped: every
 * non-empty group of a call in one cublasGemmGroupedBatchedEx (each group its own
 * problem; the offsets are host memory), or one cuBLASLt GEMM per group where cuBLAS
 * refuses that precision.
 *
 * bf16 / fp16 (set_precision): the operands are 16-bit, outputs fp32, compute fp32. A
 * weight operand inside the parameter arena is read from a 16-bit shadow of the arena
 * (refreshed after every optimizer step); activation and gradient operands are rounded
 * into one of two workspaces sized at set_precision, so nothing is allocated in a step.
 * With bf16 gradients of bf16 master weights (grads_in_shadow) a weight gradient inside
 * the gradient arena's expert part is written (and added to) in a bf16 copy of that part
 * instead (dw_target). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/fill_random.cuh"

/* ---- precision: the shadow and the rounding workspaces ---- */
static moe_precision prec = MOE_PREC_FP32;
static const real *master; /* the fp32 parameter arena */
static size_t master_n;
static uint16_t *shadow; /* (master_n) 16-bit copy */
/* bf16 master weights (master_in_shadow): [master16_from, master_n) are updated in the
 * shadow only; master_stale while the arena's fp32 copies of them are behind it */
static size_t master16_from = SIZE_MAX;
static int master_stale;
static int shadow_fresh; /* the optimizer wrote the shadow with the parameters */
/* bf16 gradients of the bf16 master weights (grads_in_shadow): the gradients [grads16_base +
 * master16_from, grads16_base + master_n) are written (and added to) by the GEMMs in
 * grad16 (element i of the arena at grad16[i - master16_from]), never in the fp32 arena */
static const real *grads16_base;
static uint16_t *grad16;
static uint16_t *ws16[2]; /* rounded operands: [0] inputs x, [1] output gradients */
static size_t ws16_n;

static cudaDataType_t operand_type(void)
{
    return prec == MOE_PREC_BF16 ? CUDA_R_16BF : prec == MOE_PREC_FP16 ? CUDA_R_16F : CUDA_R_32F;
}

/* dst[i] = src[i] rounded, one element per thread: any alignment and any n. */
static __global__ void round_kernel(uint16_t *dst, const float *src, size_t n, int bf16)
{
    MOE_CUDA_GRID_STRIDE(i, n) { dst[i] = moe_round16(src[i], bf16); }
}

/* The same over n4 groups of 4 elements: one 16-byte load and one 8-byte store each
 * (element 0 in the low half of each word: little-endian). */
static __global__ void round4_kernel(uint2 *dst, const float4 *src, size_t n4, int bf16)
{
    MOE_CUDA_GRID_STRIDE(i, n4) { dst[i] = moe_round16x4(src[i], bf16); }
}

/* Rounds n fp32 values into dst: vectorized where src is 16-byte and dst 8-byte aligned
 * and n % 4 == 0 (the runtime's buffers), else one element per thread. */
static void round_into(uint16_t *dst, const real *src, size_t n)
{
    if (n == 0)
        return;
    const int bf16 = prec == MOE_PREC_BF16;
    if (n % 4 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 8 == 0)
        MOE_CUDA_LAUNCH(round4_kernel, moe_cuda_blocks(n / 4, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                        0, (uint2 *)dst, (const float4 *)src, n / 4, bf16);
    else
        MOE_CUDA_LAUNCH(round_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS, 0,
                        dst, src, n, bf16);
}

/* The same for other kernels (attention's 16-bit copies of its operands). */
extern "C" void cuda_round_operand(uint16_t *dst, const real *src, size_t n)
{
    round_into(dst, src, n);
}

static int grouped_ready(void);

extern "C" moe_status cuda_gemm_set_precision(moe_precision p, const real *params, size_t n,
                                              size_t max_operand)
{
    if (!grouped_ready()) /* made here, so no step allocates it */
        MOE_FAIL(MOE_ERR_DEVICE, "cannot create the cuBLAS handle of the grouped GEMMs");
    cudaFree(shadow);
    cudaFree(ws16[0]);
    cudaFree(ws16[1]);
    cudaFree(grad16);
    shadow = ws16[0] = ws16[1] = grad16 = NULL;
    grads16_base = NULL;
    prec = MOE_PREC_FP32;
    master = params;
    master_n = n;
    master16_from = SIZE_MAX;
    master_stale = shadow_fresh = 0; /* a new shadow: the next refresh rounds it */
    if (p == MOE_PREC_FP32)
        return MOE_OK;
    if (!MOE_CUDA_OK(cudaMalloc((void **)&shadow, sizeof(uint16_t) * (n ? n : 1))) ||
        !MOE_CUDA_OK(
            cudaMalloc((void **)&ws16[0], sizeof(uint16_t) * (max_operand ? max_operand : 1))) ||
        !MOE_CUDA_OK(
            cudaMalloc((void **)&ws16[1], sizeof(uint16_t) * (max_operand ? max_operand : 1))))
        MOE_FAIL(MOE_ERR_DEVICE,
                 "cannot allocate the 16-bit parameter shadow (%zu elements) and "
                 "two operand workspaces (%zu elements each)",
                 n, max_operand);
    ws16_n = max_operand;
    prec = p;
    return MOE_OK;
}

/* The precision set by cuda_gemm_set_precision (attention.cu picks its kernels by it). */
extern "C" moe_precision cuda_gemm_precision(void) { return prec; }

extern "C" moe_status cuda_gemm_refresh_shadow(void)
{
    if (shadow_fresh) { /* already rounded by the AdamW pass that changed them */
        shadow_fresh = 0;
        return MOE_OK;
    }
    if (prec != MOE_PREC_FP32)
        round_into(shadow, master, master_n);
    master_stale = 0; /* the arena was written: it holds every parameter */
    return MOE_OK;
}

extern "C" moe_status cuda_gemm_master_in_shadow(size_t from)
{
    if (prec != MOE_PREC_BF16 || !shadow)
        MOE_FAIL(MOE_ERR_INVALID, "[precision] master_weights = bf16 needs bf16 GEMMs "
                                  "([precision] mode = bf16) and the parameters registered");
    if (from > master_n)
        MOE_FAIL(MOE_ERR_INVALID, "bf16 master weights from element %zu of an arena of %zu", from,
                 master_n);
    master16_from = from;
    return MOE_OK;
}

extern "C" moe_status cuda_gemm_grads_in_shadow(const real *grads)
{
    if (master16_from == SIZE_MAX)
        MOE_FAIL(MOE_ERR_INVALID, "bf16 gradients are those of bf16 master weights: "
                                  "master_in_shadow first");
    cudaFree(grad16);
    grad16 = NULL;
    grads16_base = NULL;
    if (!grads)
        return MOE_OK;
    const size_t n = master_n - master16_from;
    if (!MOE_CUDA_OK(cudaMalloc((void **)&grad16, sizeof(uint16_t) * (n ? n : 1))))
        MOE_FAIL(MOE_ERR_DEVICE, "cannot allocate the bf16 gradients (%zu elements)", n);
    grads16_base = grads;
    return MOE_OK;
}

/* Where the gradients x .. x + n live in bf16 (grads_in_shadow): their place in the bf16
 * copy; NULL when they lie outside it (fp32, in place). */
extern "C" uint16_t *cuda_gemm_grad16_at(const void *x, size_t n)
{
    if (!grad16 || !x)
        return NULL;
    const real *r = (const real *)x, *lo = grads16_base + master16_from;
    if (r < lo || r >= grads16_base + master_n)
        return NULL;
    if (n > (size_t)(grads16_base + master_n - r)) {
        MOE_CUDA_FAIL("%zu gradients run past the end of the bf16 gradients", n);
        return NULL;
    }
    return grad16 + (r - lo);
}

/* dst[i] = widened src[i] (bf16 to fp32: exact). */
static __global__ void widen_bf16_kernel(real *dst, const uint16_t *src, size_t n)
{
    MOE_CUDA_GRID_STRIDE(i, n) { dst[i] = moe_bf16_widen(src[i]); }
}

extern "C" void cuda_gemm_sync_master(void)
{
    if (grad16 && master_n > master16_from) /* the bf16 gradients too (dump writes them) */
        MOE_CUDA_LAUNCH(widen_bf16_kernel,
                        moe_cuda_blocks(master_n - master16_from, MOE_CUDA_THREADS),
                        MOE_CUDA_THREADS, 0, (real *)grads16_base + master16_from, grad16,
                        master_n - master16_from);
    if (!master_stale)
        return;
    const size_t n = master_n - master16_from;
    if (n > 0)
        MOE_CUDA_LAUNCH(widen_bf16_kernel, moe_cuda_blocks(n, MOE_CUDA_THREADS), MOE_CUDA_THREADS,
                        0, (real *)master + master16_from, shadow + master16_from, n);
    master_stale = 0;
}

/* For AdamW over the whole registered arena in a 16-bit precision: the shadow to write
 * in the same pass (and *bf16 its format), the next refresh then skipped; else NULL.
 * *from16: the first element whose master weight is the shadow's (n when none); the
 * arena's fp32 copies of those go stale. *g16: where g is the registered gradients
 * (grads_in_shadow), their bf16 copy from *from16 on (element i at (*g16)[i - *from16]);
 * else NULL. */
extern "C" uint16_t *cuda_gemm_shadow_for_update(const real *p, const real *g, size_t n, int *bf16,
                                                 size_t *from16, const uint16_t **g16)
{
    *from16 = n;
    *g16 = NULL;
    if (prec == MOE_PREC_FP32 || p != master || n != master_n || !shadow)
        return NULL;
    *bf16 = prec == MOE_PREC_BF16;
    shadow_fresh = 1;
    if (master16_from < n) {
        *from16 = master16_from;
        master_stale = 1;
        if (g && g == grads16_base)
            *g16 = grad16;
    }
    return shadow;
}

/* The 16-bit operand of a weight: its place in the shadow. */
static const void *weight_operand(const real *w)
{
    if (prec == MOE_PREC_FP32)
        return w;
    if (w < master || w >= master + master_n) {
        MOE_CUDA_FAIL("a GEMM weight outside the parameter arena in 16-bit mode");
        return NULL;
    }
    return shadow + (w - master);
}

/* Buffers that hold their GEMM operand (or another 16-bit value) themselves (backend.h
 * mark_operand): a table searched by address. A model marks up to 14 per layer and chunk
 * (12 in a MoE layer without shared experts) and 12 more: 8192 covers 32 layers in 16
 * chunks; the search is as long as the table is full (60 entries at the bench shape). */
#define OPERAND_MARKS 8192
static struct {
    const void *p;
    size_t n;
} marks[OPERAND_MARKS];
static int n_marks;

extern "C" moe_status cuda_gemm_mark_operand(const void *p, size_t n)
{
    for (int i = 0; i < n_marks; i++)
        if (marks[i].p == p) {
            if (n) {
                marks[i].n = n;
            } else {
                marks[i] = marks[--n_marks];
            }
            return MOE_OK;
        }
    if (!n || !p)
        return MOE_OK;
    if (n_marks == OPERAND_MARKS)
        MOE_FAIL(MOE_ERR_INVALID, "cuda: more than %d buffers marked as GEMM operands",
                 OPERAND_MARKS);
    marks[n_marks].p = p;
    marks[n_marks++].n = n;
    return MOE_OK;
}

/* In a 16-bit precision: whether x (n elements) is a marked buffer, which then holds its
 * 16-bit operand (*bf16 its format); for its writers and readers. */
extern "C" int cuda_operand_in_place(const void *x, size_t n, int *bf16)
{
    if (prec == MOE_PREC_FP32 || !x)
        return 0;
    for (int i = 0; i < n_marks; i++)
        if (marks[i].p == x && n <= marks[i].n) {
            *bf16 = prec == MOE_PREC_BF16;
            return 1;
        }
    return 0;
}

/* Where x (n elements) starts inside a marked buffer, at its element e: the place of its
 * 16-bit values (the buffer's 16-bit element e); NULL where x is in none. The LM head
 * reads the final norm's output (marked) a chunk of rows at a time. */
static const void *marked_interior(const real *x, size_t n)
{
    for (int i = 0; i < n_marks; i++) {
        const real *p = (const real *)marks[i].p;
        if (x > p && x < p + marks[i].n) {
            const size_t e = (size_t)(x - p);
            if (e + n > marks[i].n) {
                MOE_CUDA_FAIL("a GEMM operand of %zu elements at element %zu of a marked buffer "
                              "of %zu runs past its end",
                              n, e, marks[i].n);
                return NULL;
            }
            return (const uint16_t *)p + e;
        }
    }
    return NULL;
}

/* The operand of an activation or gradient of n elements: rounded into workspace i, or
 * the buffer itself when it holds its operand (marked; a part of a marked buffer: its
 * part of the 16-bit values). */
static const void *rounded_operand(const real *x, size_t n, int i)
{
    int bf16 = 0;
    if (prec == MOE_PREC_FP32)
        return x;
    if (cuda_operand_in_place(x, n, &bf16))
        return x;
    const void *part = marked_interior(x, n);
    if (part)
        return part;
    if (n > ws16_n) {
        MOE_CUDA_FAIL("a GEMM operand of %zu elements exceeds the %zu-element workspace", n,
                      ws16_n);
        return NULL;
    }
    round_into(ws16[i], x, n);
    return ws16[i];
}

#define PLAN_SLOTS 1024
#define TUNE_ALGOS 8 /* the heuristic's candidates a plan times (plan_tune) */

/* n and k (the dimensions that follow the token count: rows of an expert vary every
 * step) are keyed by bucket where they are a layout's column count (never bounded by a
 * leading dimension), the next power of two above 64: the algorithm is chosen
 * for the bucket's largest shape (so its workspace suffices) and the layouts are set to
 * the real sizes at each call. Where cuBLASLt refuses that algorithm for a real shape,
 * an exact plan (exact = 1) is built for it. */
typedef struct {
    int ta, tb, m, n, k, lda, ldb, ldc;
    int align_a, align_b, align_c, accumulate;
    int operand_type;     /* cudaDataType_t of A and B */
    int exact;            /* n and k are the real sizes, not buckets */
    int out16;            /* 0: C is fp32; else C's cudaDataType_t (16-bit, a marked output) */
    int batch;            /* 1, or more: a strided batch (GEMM i's A, B, C at i sa, sb, sc) */
    long long sa, sb, sc; /* elements of A's, B's (operand type) and C's (its type) */
    int tune;             /* the candidates timed (plan_tune), else the heuristic's first */
} gemm_key;

typedef struct {
    int used;
    gemm_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, lc;
    int cur_n, cur_k; /* the sizes the layouts describe now */
    cublasLtMatmulAlgo_t algo;
} gemm_plan;

static int bucket(int x)
{
    if (x <= 64)
        return x;
    int b = 128;
    while (b < x && b < (1 << 30))
        b <<= 1;
    return b;
}

static gemm_plan plans[PLAN_SLOTS];
static int n_plans;

static void plan_destroy(gemm_plan *p)
{
    if (p->lc)
        MOE_LT_OK(cublasLtMatrixLayoutDestroy(p->lc));
    if (p->lb)
        MOE_LT_OK(cublasLtMatrixLayoutDestroy(p->lb));
    if (p->la)
        MOE_LT_OK(cublasLtMatrixLayoutDestroy(p->la));
    if (p->op)
        MOE_LT_OK(cublasLtMatmulDescDestroy(p->op));
    memset(p, 0, sizeof *p);
}

static unsigned key_hash(const gemm_key *k)
{
    const int *v = (const int *)k;
    unsigned h = 2166136261u;
    for (size_t i = 0; i < sizeof *k / sizeof(int); i++)
        h = (h ^ (unsigned)v[i]) * 16777619u;
    return h;
}

/* The largest power of two (4..256) that divides the address. */
static int alignment(const void *p)
{
    uintptr_t a = (uintptr_t)p;
    int al = 256;
    while (al > 4 && a % (uintptr_t)al)
        al >>= 1;
    return al;
}

/* Makes layout l a strided batch of count matrices, stride elements apart. */
static int layout_batch(cublasLtMatrixLayout_t l, int count, long long stride)
{
    const int32_t c = count;
    const int64_t s = stride;
    return MOE_LT_OK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &c,
                                                      sizeof c)) &&
           MOE_LT_OK(cublasLtMatrixLayoutSetAttribute(
               l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof s));
}

static int plan_tune(const gemm_plan *p, const cublasLtMatmulHeuristicResult_t *cand, int found,
                     uint64_t ws_limit, cudaStream_t after);

/* after: the stream of the GEMM's first call (plan_tune waits for its queued work). */
static int plan_build(gemm_plan *p, const gemm_key *k, cudaStream_t after)
{
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t result[TUNE_ALGOS];
    int found = 0, ok = 0;
    size_t ws_bytes = 0;
    void *ws = moe_cuda_workspace(&ws_bytes);
    const uint64_t ws_limit = ws ? ws_bytes : 0;
    const cublasOperation_t opa = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t opb = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint32_t al_a = (uint32_t)k->align_a, al_b = (uint32_t)k->align_b,
                   al_c = (uint32_t)k->align_c;
    memset(p, 0, sizeof *p);
    p->key = *k;
    if (!MOE_LT_OK(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        !MOE_LT_OK(
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa)) ||
        !MOE_LT_OK(
            cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb)) ||
        !MOE_LT_OK(cublasLtMatrixLayoutCreate(&p->la, (cudaDataType_t)k->operand_type,
                                              k->ta ? k->k : k->m, k->ta ? k->m : k->k, k->lda)) ||
        !MOE_LT_OK(cublasLtMatrixLayoutCreate(&p->lb, (cudaDataType_t)k->operand_type,
                                              k->tb ? k->n : k->k, k->tb ? k->k : k->n, k->ldb)) ||
        !MOE_LT_OK(cublasLtMatrixLayoutCreate(
            &p->lc, k->out16 ? (cudaDataType_t)k->out16 : CUDA_R_32F, k->m, k->n, k->ldc)) ||
        (k->batch > 1 &&
         (!layout_batch(p->la, k->batch, k->sa) || !layout_batch(p->lb, k->batch, k->sb) ||
          !layout_batch(p->lc, k->batch, k->sc))) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceCreate(&pref)) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_limit, sizeof ws_limit)) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a)) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b)) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c)) ||
        !MOE_LT_OK(cublasLtMatmulPreferenceSetAttribute(
            pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c)) ||
        !MOE_LT_OK(cublasLtMatmulAlgoGetHeuristic(moe_cuda_lt(), p->op, p->la, p->lb, p->lc, p->lc,
                                                  pref, k->tune ? TUNE_ALGOS : 1, result, &found)))
        goto done;
    if (found < 1) {
        MOE_CUDA_FAIL("cuBLASLt has no algorithm for m=%d n=%d k=%d (transa %d transb %d, "
                      "operand type %d)",
                      k->m, k->n, k->k, k->ta, k->tb, k->operand_type);
        goto done;
    }
    p->algo = result[0].algo;
    p->cur_n = k->n;
    p->cur_k = k->k;
    if (found > 1)
        p->algo = result[plan_tune(p, result, found, ws_limit, after)].algo;
    p->used = 1;
    ok = 1;
done:
    if (pref)
        MOE_LT_OK(cublasLtMatmulPreferenceDestroy(pref));
    if (!ok)
        plan_destroy(p);
    return ok;
}

/* ---- a shape's candidates timed (plan_tune; on by default, MOE_GEMM_TUNE=0 turns it off) ----
 * cuBLASLt's heuristic ranks its candidates by a model of the device, not by running them.
 * At the bench shape its first was up to 1.5 times slower than another of the same shape
 * (forty-second session, bench/gemm_algos_probe.cu: the output projection's forward with
 * the residual added, 109 against 71 us on an H100). A plan's first use times the first
 * TUNE_ALGOS candidates and keeps the fastest of those that give the heuristic first's
 * bits on random operands of the shape: a product's bits do not depend on whether it was
 * timed, or on which candidate the timing favoured. A candidate replaces the first only
 * if it is clearly faster (TUNE_GAIN times the first's time is more than its own): in
 * the bench (same session, H100) picks within 5% of the first made the LM head's backward
 * GEMMs slower in the step than alone (the weight gradient 396 -> 443 us), while the
 * output projection's (117 -> 77 us in the step) held in every process. With TUNE_GAIN
 * 0.8 (forty-third session, three H100s) the output projection's forward took 113 -> 74
 * us in the step and the step 0.12-0.34 ms less (faster in 5 rounds of 6). The
 * candidates are timed in TUNE_ROUNDS rounds in turn, each keeping its least (a drift or
 * a burst of other work falls on every candidate alike). The operands are
 * buffers of the tuning's own (stream-ordered allocations on its own stream, freed at the
 * end) with a workspace of its own, so nothing the step uses is touched; the stream
 * first waits for the work queued on the GEMM's stream, so the timing sees a quieter
 * device (a host wait once per shape, in the first step). Where the buffers cannot
 * be had (memory), the first is kept. */
#define TUNE_REPS 5
#define TUNE_ROUNDS 3
#define TUNE_GAIN 0.8

static cudaStream_t tune_stream;
static cudaEvent_t tune_ev[3];
static int *tune_flag;        /* device: a difference found */
static long n_tuned, n_other; /* plans timed; of those, a candidate other than the first kept */

static __global__ void tune_differ_kernel(const uint16_t *a, const uint16_t *b, size_t n,
                                          int *differ)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        if (a[i] != b[i])
            *differ = 1;
}

/* The index among cand[0 .. found) to keep (0: the first; see above). */
static int plan_tune(const gemm_plan *p, const cublasLtMatmulHeuristicResult_t *cand, int found,
                     uint64_t ws_limit, cudaStream_t after)
{
    const gemm_key *k = &p->key;
    if (!tune_stream) {
        int least = 0, greatest = 0;
        if (!MOE_CUDA_OK(cudaDeviceGetStreamPriorityRange(&least, &greatest)) ||
            !MOE_CUDA_OK(
                cudaStreamCreateWithPriority(&tune_stream, cudaStreamNonBlocking, greatest)))
            return 0;
        for (int i = 0; i < 3; i++)
            if (!MOE_CUDA_OK(cudaEventCreateWithFlags(&tune_ev[i], i == 2 ? cudaEventDisableTiming
                                                                          : cudaEventDefault)))
                return 0;
        if (!MOE_CUDA_OK(cudaMalloc(&tune_flag, sizeof(int))))
            return 0;
    }
    const size_t ob = k->operand_type == CUDA_R_32F ? 4 : 2, cb = k->out16 ? 2 : 4;
    const int ct = k->out16 ? k->out16 : CUDA_R_32F;
    const size_t last = (size_t)(k->batch > 1 ? k->batch - 1 : 0);
    const size_t na = last * (size_t)k->sa + (size_t)k->lda * (k->ta ? k->m : k->k);
    const size_t nb = last * (size_t)k->sb + (size_t)k->ldb * (k->tb ? k->k : k->n);
    const size_t nc = last * (size_t)k->sc + (size_t)k->ldc * k->n;
    /* A, B, the base C, the first's D, a candidate's D, the workspace: 256-byte aligned */
    const size_t part[6] = {na * ob, nb * ob, nc * cb, nc * cb, nc * cb, (size_t)ws_limit};
    size_t off[6], total = 0;
    for (int i = 0; i < 6; i++) {
        off[i] = total;
        total += (part[i] + 255) / 256 * 256;
    }
    char *buf = NULL;
    if (!MOE_CUDA_OK(cudaEventRecord(tune_ev[2], after)) ||
        !MOE_CUDA_OK(cudaStreamWaitEvent(tune_stream, tune_ev[2], 0)))
        return 0;
    if (cudaMallocAsync((void **)&buf, total, tune_stream) != cudaSuccess) {
        (void)cudaGetLastError(); /* not enough memory: the first is kept */
        return 0;
    }
    void *A = buf + off[0], *B = buf + off[1], *Cin = buf + off[2], *D0 = buf + off[3],
         *D = buf + off[4], *ws = ws_limit ? buf + off[5] : NULL;
    const int types[3] = {k->operand_type, k->operand_type, ct};
    const size_t counts[3] = {na, nb, nc};
    void *fills[3] = {A, B, Cin};
    for (int i = 0; i < 3; i++) {
        moe_fill_random_kernel<<<1024, 256, 0, tune_stream>>>(
            fills[i], counts[i], 0x9e3779b9u * (i + 1), types[i], 1.0f);
        MOE_CUDA_OK(cudaGetLastError());
    }
    MOE_CUDA_OK(cudaMemsetAsync(D0, 0, nc * cb, tune_stream)); /* gaps of a strided batch */
    MOE_CUDA_OK(cudaMemsetAsync(D, 0, nc * cb, tune_stream));
    const float alpha = 1.0f, beta = k->accumulate ? 1.0f : 0.0f;
    /* (1) the candidates that run and give the first's bits (the first call a warm-up) */
    int elig[TUNE_ALGOS], n_elig = 0;
    for (int i = 0; i < found && i < TUNE_ALGOS; i++) {
        if (cand[i].state != CUBLAS_STATUS_SUCCESS || cand[i].workspaceSize > ws_limit)
            continue;
        if (cublasLtMatmul(moe_cuda_lt(), p->op, &alpha, A, p->la, B, p->lb, &beta, Cin, p->lc,
                           i == 0 ? D0 : D, p->lc, &cand[i].algo, ws, ws_limit,
                           tune_stream) != CUBLAS_STATUS_SUCCESS) {
            if (i == 0)
                break; /* the first refused: nothing to compare with; the first is kept */
            continue;
        }
        if (i > 0) {
            int differ = 0;
            MOE_CUDA_OK(cudaMemsetAsync(tune_flag, 0, sizeof(int), tune_stream));
            tune_differ_kernel<<<1024, 256, 0, tune_stream>>>(
                (const uint16_t *)D, (const uint16_t *)D0, nc * cb / 2, tune_flag);
            MOE_CUDA_OK(cudaGetLastError());
            if (!MOE_CUDA_OK(cudaMemcpyAsync(&differ, tune_flag, sizeof(int),
                                             cudaMemcpyDeviceToHost, tune_stream)) ||
                !MOE_CUDA_OK(cudaStreamSynchronize(tune_stream)) || differ)
                continue;
        }
        elig[n_elig++] = i;
    }
    /* (2) TUNE_ROUNDS rounds over them in turn, TUNE_REPS calls each; a candidate's time is
     * its least round (a drift or a burst of other work falls on every candidate alike) */
    float least[TUNE_ALGOS];
    for (int e = 0; e < n_elig; e++)
        least[e] = -1.0f;
    for (int r = 0; r < TUNE_ROUNDS && n_elig > 1 && elig[0] == 0; r++)
        for (int e = 0; e < n_elig; e++) {
            const int i = elig[e];
            int ok = MOE_CUDA_OK(cudaEventRecord(tune_ev[0], tune_stream));
            for (int c = 0; c < TUNE_REPS && ok; c++)
                ok = cublasLtMatmul(moe_cuda_lt(), p->op, &alpha, A, p->la, B, p->lb, &beta, Cin,
                                    p->lc, D, p->lc, &cand[i].algo, ws, ws_limit,
                                    tune_stream) == CUBLAS_STATUS_SUCCESS;
            float ms = 0.0f;
            if (ok && MOE_CUDA_OK(cudaEventRecord(tune_ev[1], tune_stream)) &&
                MOE_CUDA_OK(cudaEventSynchronize(tune_ev[1])) &&
                MOE_CUDA_OK(cudaEventElapsedTime(&ms, tune_ev[0], tune_ev[1])) &&
                (least[e] < 0.0f || ms < least[e]))
                least[e] = ms;
        }
    int keep = 0, timed = 0;
    float best_ms = n_elig > 0 ? least[0] : -1.0f;
    for (int e = 0; e < n_elig; e++) {
        if (least[e] < 0.0f)
            continue;
        timed++;
        if (e > 0 && best_ms > 0.0f && least[e] < best_ms && least[e] < TUNE_GAIN * least[0]) {
            best_ms = least[e];
            keep = elig[e];
        }
    }
    MOE_CUDA_OK(cudaFreeAsync(buf, tune_stream));
    MOE_CUDA_OK(cudaStreamSynchronize(tune_stream));
    if (timed > 1) {
        n_tuned++;
        n_other += keep != 0;
    }
    return keep;
}

/* Plans whose candidates were timed since the start, and of those, the plans that keep a
 * candidate other than the heuristic's first (for tests and the bench). */
extern "C" long moe_cuda_gemm_tuned(long *other)
{
    if (other)
        *other = n_other;
    return n_tuned;
}

/* The cached plan of k, built on first use; NULL on failure (recorded). */
static gemm_plan *plan_get(const gemm_key *k, cudaStream_t after)
{
    if (n_plans >= PLAN_SLOTS * 3 / 4) {
        for (int i = 0; i < PLAN_SLOTS; i++)
            if (plans[i].used)
                plan_destroy(&plans[i]);
        n_plans = 0;
    }
    unsigned i = key_hash(k) % PLAN_SLOTS;
    while (plans[i].used) {
        if (memcmp(&plans[i].key, k, sizeof *k) == 0)
            return &plans[i];
        i = (i + 1) % PLAN_SLOTS;
    }
    if (!plan_build(&plans[i], k, after))
        return NULL;
    n_plans++;
    return &plans[i];
}

/* Sets the plan's layouts to the real n and k (rows, columns as at plan_build). */
static int plan_resize(gemm_plan *p, int n, int k)
{
    const gemm_key *q = &p->key;
    const uint64_t ar = (uint64_t)(q->ta ? k : q->m), ac = (uint64_t)(q->ta ? q->m : k);
    const uint64_t br = (uint64_t)(q->tb ? n : k), bc = (uint64_t)(q->tb ? k : n);
    const uint64_t cc = (uint64_t)n;
    if (!MOE_LT_OK(
            cublasLtMatrixLayoutSetAttribute(p->la, CUBLASLT_MATRIX_LAYOUT_ROWS, &ar, sizeof ar)) ||
        !MOE_LT_OK(
            cublasLtMatrixLayoutSetAttribute(p->la, CUBLASLT_MATRIX_LAYOUT_COLS, &ac, sizeof ac)) ||
        !MOE_LT_OK(
            cublasLtMatrixLayoutSetAttribute(p->lb, CUBLASLT_MATRIX_LAYOUT_ROWS, &br, sizeof br)) ||
        !MOE_LT_OK(
            cublasLtMatrixLayoutSetAttribute(p->lb, CUBLASLT_MATRIX_LAYOUT_COLS, &bc, sizeof bc)) ||
        !MOE_LT_OK(
            cublasLtMatrixLayoutSetAttribute(p->lc, CUBLASLT_MATRIX_LAYOUT_COLS, &cc, sizeof cc)))
        return 0;
    p->cur_n = n;
    p->cur_k = k;
    return 1;
}

/* Column-major C (m,n) = op(A) op(B) (+ C when accumulate); C is contiguous (ldc = m). */
/* The grouped GEMMs that run one by one are spread over lanes: lane 0 is the backend's
 * stream with its workspace, lanes 1 .. SIDE_LANES side streams, each with its own
 * workspace of the same size (made with the grouped handle, so nothing is allocated in a
 * step). The problems of one call write disjoint outputs, so they may run at once; small
 * ones (an expert's 1024 rows) leave SMs idle in their last wave otherwise. */
#define SIDE_LANES 7    /* the most (MOE_GEMM_STREAMS up to 8) */
#define DEFAULT_LANES 4 /* the backend's stream and 3 side streams */
static cudaStream_t side_stream[SIDE_LANES];
static void *side_ws[SIDE_LANES];
static cudaEvent_t fork_ev, join_ev[SIDE_LANES];
static int lanes = 1; /* used: DEFAULT_LANES unless MOE_GEMM_STREAMS says otherwise */

static cudaStream_t lane_stream(int lane)
{
    return lane ? side_stream[lane - 1] : moe_cuda_stream();
}

static void *lane_workspace(int lane, size_t *nbytes)
{
    void *ws = moe_cuda_workspace(nbytes);
    return lane ? side_ws[lane - 1] : ws;
}

/* A strided batch of GEMMs: count 1 (one GEMM), or more, GEMM i's A, B, C the first's
 * plus i sa, i sb (elements of the operand type) and i sc (elements of C's type). */
typedef struct {
    int count;
    long long sa, sb, sc;
} gemm_batch;

static const gemm_batch single = {1, 0, 0, 0};

/* The alignment of every matrix of a batch: of the first and of the strides. */
static int batch_alignment(const void *p, long long stride, size_t elem)
{
    const int a = alignment(p), s = alignment((const void *)(uintptr_t)(stride * (long long)elem));
    return a < s ? a : s;
}

/* The kernel profile's name of a cuBLASLt GEMM: "cublasLt GEMM", or with
 * MOE_PROFILE_GEMM_SHAPES=1 in the environment its shape (column-major m n k, the
 * transposes, the output type, beta 1 as "+=", a batch of n as "xn"; a size that is not a
 * multiple of 128, as the experts' rows are, shown "~" rounded to 256, so that a call's
 * experts share a line). The names are kept in a table for the profile's keys. */
static const char *gemm_prof_name(int ta, int tb, int m, int n, int k, int out16, int accumulate,
                                  int batch)
{
    static int shapes = -1, used;
    static char names[160][96];
    if (shapes < 0) {
        const char *e = getenv("MOE_PROFILE_GEMM_SHAPES");
        shapes = e && strcmp(e, "1") == 0;
    }
    if (!shapes)
        return "cublasLt GEMM";
    char dim[3][16], name[96], times[16] = "";
    const int v[3] = {m, n, k};
    for (int i = 0; i < 3; i++)
        if (v[i] % 128 == 0)
            snprintf(dim[i], sizeof dim[i], "%d", v[i]);
        else
            snprintf(dim[i], sizeof dim[i], "~%d", (v[i] + 128) / 256 * 256);
    if (batch > 1)
        snprintf(times, sizeof times, " x%d", batch);
    snprintf(name, sizeof name, "GEMM %s %s %s %c%c %s%s%s", dim[0], dim[1], dim[2], ta ? 'T' : 'N',
             tb ? 'T' : 'N', out16 ? "16" : "32", accumulate ? " +=" : "", times);
    for (int i = 0; i < used; i++)
        if (strcmp(names[i], name) == 0)
            return names[i];
    if (used == (int)(sizeof names / sizeof names[0]))
        return "cublasLt GEMM (other shapes)";
    memcpy(names[used], name, sizeof name);
    return names[used++];
}

/* out16: 0 when C is fp32, else its 16-bit cudaDataType_t (a marked output, written).
 * accumulate: C = base + A B, base = Cin (of C's layout), or C itself where Cin is NULL. */
static void gemm_on(int lane, int ta, int tb, int m, int n, int k, const void *A, int lda,
                    const void *B, int ldb, void *C, const void *Cin, int ldc, int accumulate,
                    int out16, gemm_batch bt)
{
    if (!Cin)
        Cin = C;
    const size_t c_bytes = out16 ? sizeof(uint16_t) : sizeof(real);
    if (m <= 0 || n <= 0 || !A || !B)
        return;
    if (k <= 0) { /* an empty sum */
        for (int b = 0; b < bt.count; b++) {
            char *c = (char *)C + b * bt.sc * c_bytes;
            if (!accumulate)
                MOE_CUDA_OK(cudaMemsetAsync(c, 0, c_bytes * (size_t)m * n, lane_stream(lane)));
            else if (Cin != C) /* C = base (ldc = m: a whole matrix) */
                MOE_CUDA_OK(cudaMemcpyAsync(c, (const char *)Cin + b * bt.sc * c_bytes,
                                            c_bytes * (size_t)m * n, cudaMemcpyDeviceToDevice,
                                            lane_stream(lane)));
        }
        return;
    }
    const size_t op_bytes = prec == MOE_PREC_FP32 ? sizeof(real) : sizeof(uint16_t);
    gemm_key key;
    memset(&key, 0, sizeof key);
    key.ta = ta;
    key.tb = tb;
    key.m = m;
    key.n = tb ? n : bucket(n);        /* bucketed only where it is a layout's */
    key.k = !ta && tb ? bucket(k) : k; /* column count, free of the leading dimension */
    key.lda = lda;
    key.ldb = ldb;
    key.ldc = ldc;
    key.align_a = batch_alignment(A, bt.sa, op_bytes);
    key.align_b = batch_alignment(B, bt.sb, op_bytes);
    key.align_c = batch_alignment(C, bt.sc, c_bytes);
    if (batch_alignment(Cin, bt.sc, c_bytes) < key.align_c)
        key.align_c = batch_alignment(Cin, bt.sc, c_bytes);
    key.accumulate = accumulate;
    key.operand_type = (int)operand_type();
    key.out16 = out16;
    key.batch = bt.count;
    if (bt.count > 1) {
        key.sa = bt.sa;
        key.sb = bt.sb;
        key.sc = bt.sc;
    }
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    size_t ws_bytes = 0;
    void *ws = lane_workspace(lane, &ws_bytes);
    /* MOE_GEMM_TUNE=0: the heuristic's first, untimed (read each call: the tests switch
     * it; it is part of the key, so both kinds of plan coexist) */
    const int tune = !moe_cuda_env_is("MOE_GEMM_TUNE", "0");
    for (int exact = 0; exact < 2; exact++) {
        if (exact) { /* the bucket's algorithm was refused for this shape */
            key.exact = 1;
            key.n = n;
            key.k = k;
        }
        /* timed only where the call's shape is the key's own (other sizes of a bucket get
         * another key: the heuristic's first, whichever size came first), never an exact
         * plan (built in later steps, where a host wait would stall the step) */
        key.tune = tune && !exact && key.n == n && key.k == k;
        gemm_plan *p = plan_get(&key, lane_stream(lane));
        if (!p)
            return;
        if ((p->cur_n != n || p->cur_k != k) && !plan_resize(p, n, k))
            return;
        MOE_CUDA_PROF_BEGIN(gemm_prof_name(ta, tb, m, n, k, out16, accumulate, bt.count));
        const cublasStatus_t st =
            cublasLtMatmul(moe_cuda_lt(), p->op, &alpha, A, p->la, B, p->lb, &beta, Cin, p->lc, C,
                           p->lc, &p->algo, ws, ws_bytes, lane_stream(lane));
        MOE_CUDA_PROF_END();
        if (st == CUBLAS_STATUS_SUCCESS)
            return;
        if (exact || (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)) {
            MOE_LT_OK(st);
            return;
        }
    }
}

/* The type of a GEMM's output out of n elements: 0 for fp32, or (in a 16-bit precision)
 * the operand type where out is marked (backend.h mark_operand: it holds 16-bit values,
 * which a GEMM writes but never adds to). */
static int output16(const void *out, size_t n, int accumulate)
{
    int bf16 = 0;
    if (!out || !cuda_operand_in_place(out, n, &bf16))
        return 0;
    if (accumulate)
        MOE_CUDA_FAIL("a GEMM would add to a buffer marked as holding 16-bit values");
    return (int)operand_type();
}

/* A weight gradient's output dw of n elements: its bf16 copy (grads_in_shadow; *out16
 * then its type, and the GEMMs may add to it: beta 1 reads it as bf16), else dw itself
 * (*out16 as output16 gives it). */
static void *dw_target(real *dw, size_t n, int accumulate, int *out16)
{
    uint16_t *d16 = cuda_gemm_grad16_at(dw, n);
    if (d16) {
        *out16 = CUDA_R_16BF;
        return d16;
    }
    *out16 = output16(dw, n, accumulate);
    return dw;
}

/* Pointer arithmetic on an output of that type. */
static void *out_at(void *base, size_t elems, int out16)
{
    return (char *)base + elems * (out16 ? sizeof(uint16_t) : sizeof(real));
}

static void gemm(int ta, int tb, int m, int n, int k, const void *A, int lda, const void *B,
                 int ldb, real *C, int ldc, int accumulate)
{
    gemm_on(0, ta, tb, m, n, k, A, lda, B, ldb, C, NULL, ldc, accumulate,
            output16(C, (size_t)m * n, accumulate), single);
}

/* out (N,O) = base + x (N,I) W^T (base NULL: none): out^T = op_T(W stored I x O) x^T. The
 * operands are already in the GEMM precision (xo: x's operand, wo: w's). */
static void linear_forward(real *out, const real *base, const void *xo, const void *wo, int N,
                           int I, int O)
{
    gemm_on(0, 1, 0, O, N, I, wo, I, xo, I, out, base, O, base != NULL,
            output16(out, (size_t)N * O, base != NULL), single);
}

/* dx (N,I) += dout W: dx^T (I,N) = W^T (stored I x O) dout^T (O,N).
 * dw (O,I) += dout^T x: dw^T (I,O) = x^T (I,N) op_T(dout^T stored O x N). */
static void linear_backward(real *dx, real *dw, const void *douto, const void *xo, const void *wo,
                            int N, int I, int O, int write)
{
    if (dx)
        gemm(0, 0, I, N, O, wo, I, douto, O, dx, I, !(write & MOE_WRITE_DX));
    if (dw) {
        const int acc = !(write & MOE_WRITE_DW);
        int dw16 = 0;
        void *dwt = dw_target(dw, (size_t)O * I, acc, &dw16);
        gemm_on(0, 0, 1, I, O, N, xo, I, douto, O, dwt, NULL, I, acc, dw16, single);
    }
}

/* Pointer arithmetic on an operand of the current precision. */
static const void *at(const void *base, size_t elems)
{
    size_t bytes = prec == MOE_PREC_FP32 ? sizeof(real) : sizeof(uint16_t);
    return base ? (const char *)base + elems * bytes : NULL;
}

extern "C" void cuda_matmul_forward(real *out, const real *x, const real *w, int N, int I, int O)
{
    linear_forward(out, NULL, rounded_operand(x, (size_t)N * I, 0), weight_operand(w), N, I, O);
}

extern "C" void cuda_matmul_forward_add(real *out, const real *base, const real *x, const real *w,
                                        int N, int I, int O)
{
    linear_forward(out, base, rounded_operand(x, (size_t)N * I, 0), weight_operand(w), N, I, O);
}

/* One strided batch of count GEMMs (the weights' operands O*I apart in the shadow, the
 * outputs out_stride apart: in 16-bit elements where they are marked); one call per
 * product where the outputs are not all marked or all unmarked. */
extern "C" void cuda_matmul_forward_batch(real *out, size_t out_stride, const real *x,
                                          const real *w, int count, int N, int I, int O)
{
    const size_t NO = (size_t)N * O;
    const int out16 = output16(out, NO, 0);
    int same = count > 1;
    for (int c = 1; c < count && same; c++)
        same = output16(out + c * out_stride, NO, 0) == out16;
    if (!same) {
        for (int c = 0; c < count; c++)
            cuda_matmul_forward(out + c * out_stride, x, w + (size_t)c * O * I, N, I, O);
        return;
    }
    const gemm_batch bt = {count, (long long)O * I, 0,
                           (long long)(out16 ? 2 * out_stride : out_stride)};
    gemm_on(0, 1, 0, O, N, I, weight_operand(w), I, rounded_operand(x, (size_t)N * I, 0), I, out,
            NULL, O, 0, out16, bt);
}

extern "C" void cuda_matmul_backward(real *dx, real *dw, const real *dout, const real *x,
                                     const real *w, int N, int I, int O, int write)
{
    const void *douto = rounded_operand(dout, (size_t)N * O, 1);
    const void *xo = dw ? rounded_operand(x, (size_t)N * I, 0) : NULL;
    linear_backward(dx, dw, douto, xo, dx ? weight_operand(w) : NULL, N, I, O, write);
}

/* ---- grouped: every non-empty group in one cublasGemmGroupedBatchedEx call ---------- */

/* Problems of one grouped call, each its own cuBLAS "group" of size 1. The device
 * pointer table is written by a kernel whose parameter carries the pointers (so nothing
 * is copied from host memory that the next call could overwrite); it is reused by the
 * next call in stream order. More problems than GROUPED_MAX: several calls. */
#define GROUPED_MAX 256

typedef struct {
    const void *p[3 * GROUPED_MAX]; /* A of each problem, then B, then C */
} grouped_ptrs;

typedef struct {
    int n; /* problems */
    cublasOperation_t ta[GROUPED_MAX], tb[GROUPED_MAX];
    int m[GROUPED_MAX], nn[GROUPED_MAX], k[GROUPED_MAX];
    int lda[GROUPED_MAX], ldb[GROUPED_MAX], ldc[GROUPED_MAX], size[GROUPED_MAX];
    float alpha[GROUPED_MAX], beta[GROUPED_MAX];
    /* pair[i]: problem i + 1 is problem i with its A, B, C moved by stride[i] (run as one
     * strided batch of 2 where the problems run one by one) */
    int pair[GROUPED_MAX];
    gemm_batch stride[GROUPED_MAX];
    int out16[GROUPED_MAX]; /* C's type (gemm_on); a batch with one 16-bit C runs one by one */
    /* k2[i] > 0: problem i is C = op(A) op(B) + op(A2) op(B2) (+ C), the second product's A2
     * and B2 (at a2, b2) laid out as A and B with k2 for k: one sum on the wgmma kernel,
     * else the second product added after the batch (grouped_flush_cublas) */
    int k2[GROUPED_MAX];
    const void *a2[GROUPED_MAX], *b2[GROUPED_MAX];
    grouped_ptrs ptr;
} grouped_batch;

static cublasHandle_t blas;      /* the grouped GEMMs' handle, on the backend's stream */
static void **ptr_table;         /* device, 3 * GROUPED_MAX pointers */
static int grouped_refused[3];   /* per operand precision: cuBLAS refused the grouped form */
static long n_grouped, n_single; /* grouped calls made; GEMMs made one by one */
static long n_pairs;             /* of those, strided batches of 2 (each counted 2 above) */
static long n_k2_one;            /* problems of two products run as one sum (the wgmma kernel) */

static __global__ void fill_pointers_kernel(void **dst, grouped_ptrs src, int n3)
{
    for (int i = threadIdx.x; i < n3; i += blockDim.x)
        dst[i] = (void *)src.p[i];
}

/* The handle and pointer table, made once (at set_precision, or at the first grouped
 * GEMM of a program that never sets it): 0 on failure (recorded). */
static int grouped_ready(void)
{
    if (blas)
        return 1;
    size_t ws_bytes = 0;
    void *ws = moe_cuda_workspace(&ws_bytes);
    if (!MOE_LT_OK(cublasCreate(&blas)))
        return 0;
    if (!MOE_LT_OK(cublasSetStream(blas, moe_cuda_stream())) ||
        !MOE_LT_OK(cublasSetWorkspace(blas, ws, ws_bytes)) ||
        !MOE_LT_OK(cublasSetMathMode(blas, CUBLAS_DEFAULT_MATH)) || /* fp32: no TF32 */
        !MOE_CUDA_OK(cudaMalloc((void **)&ptr_table, sizeof(void *) * 3 * GROUPED_MAX))) {
        cublasDestroy(blas);
        blas = NULL;
        return 0;
    }
    const char *env = getenv("MOE_GEMM_STREAMS"); /* 1 .. 1 + SIDE_LANES; a benchmark knob */
    int want = env ? atoi(env) : DEFAULT_LANES;
    want = want < 1 ? 1 : want > 1 + SIDE_LANES ? 1 + SIDE_LANES : want;
    if (!MOE_CUDA_OK(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming)))
        return 0;
    for (int i = 0; i < want - 1; i++)
        if (!MOE_CUDA_OK(cudaStreamCreateWithPriority(&side_stream[i], cudaStreamNonBlocking,
                                                      moe_cuda_priority())) ||
            !MOE_CUDA_OK(cudaEventCreateWithFlags(&join_ev[i], cudaEventDisableTiming)) ||
            !MOE_CUDA_OK(cudaMalloc(&side_ws[i], ws_bytes)))
            return 0;
    lanes = want;
    return 1;
}

static int prec_slot(void) { return prec == MOE_PREC_BF16 ? 1 : prec == MOE_PREC_FP16 ? 2 : 0; }

/* ---- the grouped GEMMs on Hopper's wgmma (sm90/grouped_wgmma.cu) -------------------- */

#if MOE_HAVE_SM90A
#include "kernels/cuda/sm90/grouped_wgmma.h"
extern "C" int cuda_wgmma_grouped(int bf16, int amn, int bnm, const gw_args *g, int sms,
                                  cudaStream_t s);
extern "C" int cuda_wgmma_grouped_swiglu(int bf16, const gw_args *g, const uint16_t *const *up_w,
                                         void *const *up, void *const *h, int sms, cudaStream_t s);
#endif
static long n_wgmma; /* launches of the wgmma grouped kernel */

/* Whether a batch of 16-bit operands runs on the wgmma kernel: compute capability 9.0
 * and the kernel built in (the default since the twenty-fourth session), unless
 * MOE_GROUPED_GEMM=cublas in the environment (read at each call, so that a test compares
 * both) puts it on cuBLASLt, one GEMM a problem over the lanes, as on other GPUs.
 * *blocks: a launch's blocks, the SMs (MOE_GROUPED_WGMMA_BLOCKS=n fewer: a test's knob,
 * so that each block walks many tiles). */
static int wgmma_grouped_on(int *blocks)
{
#if MOE_HAVE_SM90A
    static int cc90 = -1, n_sm;
    if (prec == MOE_PREC_FP32 || moe_cuda_env_is("MOE_GROUPED_GEMM", "cublas"))
        return 0;
    if (cc90 < 0) {
        int dev = 0, major = 0, minor = 0;
        cc90 =
            MOE_CUDA_OK(cudaGetDevice(&dev)) &&
            MOE_CUDA_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) &&
            MOE_CUDA_OK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev)) &&
            MOE_CUDA_OK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev)) &&
            major == 9 && minor == 0 && n_sm > 0;
    }
    if (cc90 != 1)
        return 0;
    const char *e = getenv("MOE_GROUPED_WGMMA_BLOCKS");
    const int want = e ? atoi(e) : 0;
    *blocks = want > 0 && want < n_sm ? want : n_sm;
    return 1;
#else
    *blocks = 0;
    return 0;
#endif
}

extern "C" long moe_cuda_grouped_wgmma_launches(void) { return n_wgmma; }

#if MOE_HAVE_SM90A
static int aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Problem i's layout class on the wgmma kernel: 0 the forward (A, B K-major), 1 an input
 * gradient (B N-major), 2 a weight gradient (A M-major too). */
static int wgmma_class(const grouped_batch *g, int i)
{
    return (g->tb[i] == CUBLAS_OP_T) + (g->ta[i] == CUBLAS_OP_N);
}

/* The batch on the wgmma kernel: its problems turned row-major (cuBLAS's column-major C
 * (m, n) = op(A) op(B) is C^T (n, m) = op(B)^T op(A)^T), by the layouts of A and B, each
 * layout's launches (GW_MAX problems each) on a lane of its own. 0, with nothing queued, where a
 * problem does not fit the kernel (alignment, a size not a multiple of 8, A M-major with B
 * K-major): the caller runs the batch through cuBLAS. */
static int grouped_flush_wgmma(const grouped_batch *g, int n, int sms, cudaStream_t only)
{
    static gw_args args[3];
    int cls[GROUPED_MAX];
    for (int i = 0; i < n; i++) {
        const int amn = g->tb[i] == CUBLAS_OP_T, bnm = g->ta[i] == CUBLAS_OP_N;
        const int M = g->nn[i], N = g->m[i], K = g->k[i];
        const void *A = g->ptr.p[GROUPED_MAX + i], *B = g->ptr.p[i],
                   *C = g->ptr.p[2 * GROUPED_MAX + i];
        if ((amn && !bnm) || (amn ? M : K) % 8 || (bnm ? N : K) % 8 || g->ldb[i] % 8 ||
            g->lda[i] % 8 || g->ldc[i] % 2 || !aligned16(A) || !aligned16(B) ||
            ((uintptr_t)C & 7u) || g->beta[i] != (g->beta[i] != 0.0f ? 1.0f : 0.0f) ||
            g->alpha[i] != 1.0f ||
            (g->k2[i] > 0 && (g->k2[i] % 8 || !aligned16(g->a2[i]) || !aligned16(g->b2[i]))))
            return 0;
        cls[i] = wgmma_class(g, i); /* amn + bnm */
    }
    int used[3] = {0, 0, 0}, launches = 0, cap[3] = {GW_MAX, GW_MAX, GW_MAX};
    for (int i = 0; i < n; i++) {
        used[cls[i]] = 1;
        if (g->k2[i] > 0) /* a launch with second products: their maps at i + GW_SW */
            cap[cls[i]] = GW_SW;
    }
    for (int c = 0; c < 3; c++)
        launches += used[c];
    const int use = only ? 1 : launches < lanes ? launches : lanes;
    MOE_CUDA_PROF_BEGIN("wgmma grouped GEMM");
    if (use > 1) {
        MOE_CUDA_OK(cudaEventRecord(fork_ev, moe_cuda_stream()));
        for (int l = 1; l < use; l++)
            MOE_CUDA_OK(cudaStreamWaitEvent(side_stream[l - 1], fork_ev, 0));
    }
    int lane = 0;
    for (int c = 0; c < 3; c++) {
        if (!used[c])
            continue;
        gw_args *a = &args[c];
        a->count = 0;
        for (int i = 0; i <= n; i++) {
            if (i == n || a->count == cap[c]) { /* launch what is gathered */
                if (a->count > 0) {
                    const int bf16 = prec == MOE_PREC_BF16;
                    cudaStream_t st = only ? only : lane_stream(lane % use);
                    if (!cuda_wgmma_grouped(bf16, c == 2, c >= 1, a, sms, st))
                        MOE_CUDA_FAIL("the wgmma grouped GEMM could not be launched");
                    n_wgmma++;
                }
                a->count = 0;
                if (i == n)
                    break;
            }
            if (cls[i] != c)
                continue;
            gw_problem *p = &a->p[a->count++];
            p->a = (const uint16_t *)g->ptr.p[GROUPED_MAX + i];
            p->b = (const uint16_t *)g->ptr.p[i];
            p->c = (void *)g->ptr.p[2 * GROUPED_MAX + i];
            p->m = g->nn[i];
            p->n = g->m[i];
            p->k = g->k[i];
            p->lda = g->ldb[i];
            p->ldb = g->lda[i];
            p->ldc = g->ldc[i];
            p->flags = (g->out16[i] ? GW_OUT16 : 0) | (g->beta[i] != 0.0f ? GW_ACC : 0);
            p->k2 = g->k2[i];
            p->a2 = (const uint16_t *)g->b2[i];
            p->b2 = (const uint16_t *)g->a2[i];
            n_k2_one += g->k2[i] > 0;
        }
        lane++;
    }
    if (use > 1)
        for (int l = 1; l < use; l++) {
            MOE_CUDA_OK(cudaEventRecord(join_ev[l - 1], side_stream[l - 1]));
            MOE_CUDA_OK(cudaStreamWaitEvent(moe_cuda_stream(), join_ev[l - 1], 0));
        }
    MOE_CUDA_PROF_END();
    return 1;
}
#endif

static void grouped_flush_cublas(grouped_batch *g, int n);

/* Moves problem i of g to slot j of d. */
static void grouped_move(grouped_batch *d, int j, const grouped_batch *g, int i)
{
    d->ta[j] = g->ta[i], d->tb[j] = g->tb[i];
    d->m[j] = g->m[i], d->nn[j] = g->nn[i], d->k[j] = g->k[i];
    d->lda[j] = g->lda[i], d->ldb[j] = g->ldb[i], d->ldc[j] = g->ldc[i], d->size[j] = g->size[i];
    d->alpha[j] = g->alpha[i], d->beta[j] = g->beta[i];
    d->pair[j] = g->pair[i], d->stride[j] = g->stride[i], d->out16[j] = g->out16[i];
    d->k2[j] = g->k2[i], d->a2[j] = g->a2[i], d->b2[j] = g->b2[i];
    for (int s = 0; s < 3; s++)
        d->ptr.p[s * GROUPED_MAX + j] = g->ptr.p[s * GROUPED_MAX + i];
}

#if MOE_HAVE_SM90A
/* A trial's knob, MOE_GROUPED_WGMMA_CLASSES=mask (1 forwards, 2 input gradients, 4 weight
 * gradients; unset: all): the classes outside it go to cuBLAS. Where a batch holds both,
 * its wgmma problems run on the last lane beside its cuBLAS ones on the others. 1 where
 * the batch ran so, 0 where it holds one kind only (the caller runs it whole). */
static int grouped_flush_split(grouped_batch *g, int n, int sms)
{
    static grouped_batch wg;
    const char *e = getenv("MOE_GROUPED_WGMMA_CLASSES");
    const int mask = e ? atoi(e) : 7;
    if ((mask & 7) == 7)
        return 0; /* every class on wgmma (the default): no split, nothing counted */
    int nw = 0, nc = 0;
    for (int i = 0; i < n; i++)
        (mask >> wgmma_class(g, i) & 1 ? nw : nc)++;
    if (nc == 0)
        return 0;               /* all on wgmma */
    if (nw == 0 || lanes < 2) { /* all on cuBLAS: one lane cannot run both side by side */
        grouped_flush_cublas(g, n);
        return 1;
    }
    nw = nc = 0;
    for (int i = 0; i < n; i++) { /* a pair's two problems share a class */
        if (mask >> wgmma_class(g, i) & 1)
            grouped_move(&wg, nw++, g, i);
        else
            grouped_move(g, nc++, g, i);
    }
    cudaStream_t st = side_stream[lanes - 2];
    static cudaEvent_t fork2, join2;
    if (!fork2 && (!MOE_CUDA_OK(cudaEventCreateWithFlags(&fork2, cudaEventDisableTiming)) ||
                   !MOE_CUDA_OK(cudaEventCreateWithFlags(&join2, cudaEventDisableTiming))))
        return 0;
    /* the kernel's work lies outside the brackets within (on st): this one holds both */
    MOE_CUDA_PROF_BEGIN("grouped GEMMs, wgmma beside cuBLAS");
    MOE_CUDA_OK(cudaEventRecord(fork2, moe_cuda_stream()));
    MOE_CUDA_OK(cudaStreamWaitEvent(st, fork2, 0));
    if (!grouped_flush_wgmma(&wg, nw, sms, st))
        grouped_flush_cublas(&wg, nw); /* a problem that does not fit: on cuBLAS after all */
    lanes--;
    grouped_flush_cublas(g, nc);
    lanes++;
    MOE_CUDA_OK(cudaEventRecord(join2, st));
    MOE_CUDA_OK(cudaStreamWaitEvent(moe_cuda_stream(), join2, 0));
    MOE_CUDA_PROF_END();
    return 1;
}
#endif

/* Runs the batch's problems (one by one when cuBLAS refuses the grouped form for this
 * precision: remembered, and counted), then empties it. */
static void grouped_flush(grouped_batch *g)
{
    const int n = g->n;
    g->n = 0;
    if (n == 0)
        return;
    int sms = 0;
    if (wgmma_grouped_on(&sms) && grouped_ready()) {
#if MOE_HAVE_SM90A
        if (grouped_flush_split(g, n, sms) || grouped_flush_wgmma(g, n, sms, NULL))
            return;
#endif
    }
    grouped_flush_cublas(g, n);
}

static void grouped_flush_cublas_one(grouped_batch *g, int n);

/* The batch's n problems on cuBLAS: the problems' second products (k2) after the first
 * ones, added to C, as a batch of their own (so their sums are the two products' sums
 * added: C = (A B) + (A2 B2)). */
static void grouped_flush_cublas(grouped_batch *g, int n)
{
    static grouped_batch second;
    grouped_flush_cublas_one(g, n);
    int n2 = 0;
    for (int i = 0; i < n; i++) {
        if (g->k2[i] <= 0)
            continue;
        grouped_move(&second, n2, g, i);
        second.k[n2] = g->k2[i];
        second.k2[n2] = 0;
        second.pair[n2] = 0;
        second.beta[n2] = 1.0f;
        second.ptr.p[n2] = g->a2[i];
        second.ptr.p[GROUPED_MAX + n2] = g->b2[i];
        n2++;
    }
    if (n2 > 0)
        grouped_flush_cublas_one(&second, n2);
}

/* The batch's n problems on cuBLAS, their first products only. */
static void grouped_flush_cublas_one(grouped_batch *g, int n)
{
    int any16 = 0;
    for (int i = 0; i < n; i++)
        any16 |= g->out16[i];
    if (!any16 && !grouped_refused[prec_slot()] && grouped_ready()) {
        grouped_ptrs packed;
        for (int i = 0; i < n; i++) {
            packed.p[i] = g->ptr.p[i];
            packed.p[n + i] = g->ptr.p[GROUPED_MAX + i];
            packed.p[2 * n + i] = g->ptr.p[2 * GROUPED_MAX + i];
        }
        MOE_CUDA_LAUNCH(fill_pointers_kernel, 1, 256, 0, ptr_table, packed, 3 * n);
        const cudaDataType_t t = operand_type();
        MOE_CUDA_PROF_BEGIN("cuBLAS grouped GEMM");
        const cublasStatus_t st = cublasGemmGroupedBatchedEx(
            blas, g->ta, g->tb, g->m, g->nn, g->k, g->alpha, (const void *const *)ptr_table, t,
            g->lda, (const void *const *)(ptr_table + n), t, g->ldb, g->beta, ptr_table + 2 * n,
            CUDA_R_32F, g->ldc, n, g->size, CUBLAS_COMPUTE_32F);
        MOE_CUDA_PROF_END();
        if (st == CUBLAS_STATUS_SUCCESS) {
            n_grouped++;
            return;
        }
        if (st != CUBLAS_STATUS_NOT_SUPPORTED) {
            MOE_LT_OK(st);
            return;
        }
        grouped_refused[prec_slot()] = 1; /* this precision: one GEMM per group from now */
    }
    /* one by one, over the lanes in turn: the side streams start after what the backend's
     * stream holds (fork) and the backend's stream goes on after all of them (join) */
    int launches = 0; /* GEMM calls: a pair is one */
    for (int i = 0; i < n; i += g->pair[i] ? 2 : 1)
        launches++;
    const int use = launches < lanes ? launches : lanes;
    if (use > 1) {
        MOE_CUDA_PROF_BEGIN("cuBLASLt GEMMs on several streams"); /* the inner ones nest */
        MOE_CUDA_OK(cudaEventRecord(fork_ev, moe_cuda_stream()));
        for (int l = 1; l < use; l++)
            MOE_CUDA_OK(cudaStreamWaitEvent(side_stream[l - 1], fork_ev, 0));
    }
    for (int i = 0, j = 0; i < n; i += g->pair[i] ? 2 : 1, j++) {
        gemm_on(j % use, g->ta[i] == CUBLAS_OP_T, g->tb[i] == CUBLAS_OP_T, g->m[i], g->nn[i],
                g->k[i], g->ptr.p[i], g->lda[i], g->ptr.p[GROUPED_MAX + i], g->ldb[i],
                (void *)g->ptr.p[2 * GROUPED_MAX + i], NULL, g->ldc[i], g->beta[i] != 0.0f,
                g->out16[i], g->pair[i] ? g->stride[i] : single);
        n_single += g->pair[i] ? 2 : 1;
        n_pairs += g->pair[i];
    }
    if (use > 1) {
        for (int l = 1; l < use; l++) {
            MOE_CUDA_OK(cudaEventRecord(join_ev[l - 1], side_stream[l - 1]));
            MOE_CUDA_OK(cudaStreamWaitEvent(moe_cuda_stream(), join_ev[l - 1], 0));
        }
        MOE_CUDA_PROF_END();
    }
}

/* Adds the problem C (m,n) = op(A) op(B) (+ C): column-major, as gemm(); C of type out16. */
static void grouped_add(grouped_batch *g, int ta, int tb, int m, int n, int k, const void *A,
                        int lda, const void *B, int ldb, void *C, int ldc, int accumulate,
                        int out16)
{
    if (m <= 0 || n <= 0 || k <= 0 || !A || !B)
        return; /* every caller skips empty groups; k = 0 does not occur */
    const int i = g->n++;
    g->ta[i] = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    g->tb[i] = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    g->m[i] = m;
    g->nn[i] = n;
    g->k[i] = k;
    g->lda[i] = lda;
    g->ldb[i] = ldb;
    g->ldc[i] = ldc;
    g->size[i] = 1;
    g->alpha[i] = 1.0f;
    g->beta[i] = accumulate ? 1.0f : 0.0f;
    g->pair[i] = 0;
    g->out16[i] = out16;
    g->k2[i] = 0;
    g->ptr.p[i] = A;
    g->ptr.p[GROUPED_MAX + i] = B;
    g->ptr.p[2 * GROUPED_MAX + i] = C;
    if (g->n == GROUPED_MAX)
        grouped_flush(g);
}

/* Adds the problem and its twin at the strides s (a strided batch of 2 when run one by
 * one; two problems of the grouped call otherwise). */
static void grouped_add_pair(grouped_batch *g, int ta, int tb, int m, int n, int k, const void *A,
                             int lda, const void *B, int ldb, void *C, int ldc, int accumulate,
                             int out16, gemm_batch s)
{
    if (m <= 0 || n <= 0 || k <= 0 || !A || !B)
        return;
    if (g->n + 2 > GROUPED_MAX)
        grouped_flush(g);
    const int i = g->n;
    grouped_add(g, ta, tb, m, n, k, A, lda, B, ldb, C, ldc, accumulate, out16);
    g->pair[i] = 1; /* before the twin: adding it may flush */
    g->stride[i] = s;
    grouped_add(g, ta, tb, m, n, k, at(A, (size_t)s.sa), lda, at(B, (size_t)s.sb), ldb,
                out_at(C, (size_t)s.sc, out16), ldc, accumulate, out16);
}

/* Adds the problem C (m,n) = op(A) op(B) + op(A2) op(B2) (+ C): A2 and B2 laid out as A
 * and B (k2 for k). */
static void grouped_add_two(grouped_batch *g, int ta, int tb, int m, int n, int k, const void *A,
                            int lda, const void *B, int ldb, int k2, const void *A2, const void *B2,
                            void *C, int ldc, int accumulate, int out16)
{
    if (m <= 0 || n <= 0 || k <= 0 || k2 <= 0 || !A || !B || !A2 || !B2)
        return;
    if (g->n + 1 == GROUPED_MAX) /* the add below would flush before the second is set */
        grouped_flush(g);
    const int i = g->n;
    grouped_add(g, ta, tb, m, n, k, A, lda, B, ldb, C, ldc, accumulate, out16);
    g->k2[i] = k2;
    g->a2[i] = A2;
    g->b2[i] = B2;
}

/* Problems of two products that ran as one sum on the wgmma kernel (tests). */
extern "C" long moe_cuda_grouped_two_product_sums(void) { return n_k2_one; }

/* Strided batches of 2 run one by one so far (tests). */
extern "C" long moe_cuda_batched_pairs(void) { return n_pairs; }

/* Counts of grouped calls and of GEMMs run one by one (for tests and benchmarks). */
extern "C" void moe_cuda_grouped_counts(long *grouped_calls, long *single_gemms)
{
    *grouped_calls = n_grouped;
    *single_gemms = n_single;
}

static grouped_batch batch; /* one at a time: the backend runs on one host thread */

extern "C" void cuda_grouped_matmul_forward(real *out, const real *x, const real *w,
                                            const int *offsets, int G, int I, int O)
{
    const void *xo = rounded_operand(x, (size_t)offsets[G] * I, 0), *wo = weight_operand(w);
    const int out16 = output16(out, (size_t)offsets[G] * O, 0);
    for (int g = 0; g < G; g++) {
        const int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows > 0) /* out^T (O,rows) = W_g^T x^T, as linear_forward */
            grouped_add(&batch, 1, 0, O, rows, I, at(wo, (size_t)g * O * I), I,
                        at(xo, (size_t)m0 * I), I, out_at(out, (size_t)m0 * O, out16), O, 0, out16);
    }
    grouped_flush(&batch);
}

/* Where group g is empty and starts a run of empty groups: the run's slices of OI
 * elements of dw (of type dw16, dw_target) zeroed with one memset (a weight gradient
 * written, not added to). */
static void zero_empty_run(void *dw, int dw16, const int *offsets, int g, int G, size_t OI)
{
    if (g > 0 && offsets[g] == offsets[g - 1])
        return; /* inside a run: zeroed where it started */
    int e = g + 1;
    while (e < G && offsets[e + 1] == offsets[e])
        e++;
    const size_t bytes = dw16 ? sizeof(uint16_t) : sizeof(real);
    MOE_CUDA_OK(cudaMemsetAsync(out_at(dw, (size_t)g * OI, dw16), 0, bytes * OI * (e - g),
                                moe_cuda_stream()));
}

/* write (ops.h): the weight gradients (MOE_WRITE_DW) or the input gradient (MOE_WRITE_DX)
 * are written with beta 0, so their old contents are not read; the weight gradients'
 * slices of empty groups are zeroed, each run of them with one memset. */
extern "C" void cuda_grouped_matmul_backward(real *dx, real *dw, const real *dout, const real *x,
                                             const real *w, const int *offsets, int G, int I, int O,
                                             int write)
{
    const int dw_first = (write & MOE_WRITE_DW) != 0, dx_first = (write & MOE_WRITE_DX) != 0;
    const size_t M = (size_t)offsets[G], OI = (size_t)O * I;
    const void *douto = rounded_operand(dout, M * O, 1);
    const void *xo = dw ? rounded_operand(x, M * I, 0) : NULL;
    const void *wo = dx ? weight_operand(w) : NULL;
    const int dx16 = output16(dx, M * I, !dx_first);
    int dw16 = 0;
    void *dwt = dw ? dw_target(dw, (size_t)G * OI, !dw_first, &dw16) : NULL;
    for (int g = 0; g < G; g++) { /* as linear_backward, per group */
        const int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows <= 0) {
            if (dw && dw_first)
                zero_empty_run(dwt, dw16, offsets, g, G, OI);
            continue;
        }
        if (dx)
            grouped_add(&batch, 0, 0, I, rows, O, at(wo, (size_t)g * OI), I,
                        at(douto, (size_t)m0 * O), O, out_at(dx, (size_t)m0 * I, dx16), I,
                        !dx_first, dx16);
        if (dw)
            grouped_add(&batch, 0, 1, I, O, rows, at(xo, (size_t)m0 * I), I,
                        at(douto, (size_t)m0 * O), O, out_at(dwt, (size_t)g * OI, dw16), I,
                        !dw_first, dw16);
    }
    grouped_flush(&batch);
}

/* The distance from a to b in elements of elem bytes when b lies after a by a whole
 * number of them (a strided batch's stride), else 0. */
static long long stride_between(const void *a, const void *b, size_t elem)
{
    static int off = -1; /* MOE_GEMM_PAIR=0: never (two calls; a benchmark knob) */
    if (off < 0) {
        const char *e = getenv("MOE_GEMM_PAIR");
        off = e && strcmp(e, "0") == 0;
    }
    if (off || !a || !b || (const char *)b <= (const char *)a)
        return 0;
    const size_t d = (size_t)((const char *)b - (const char *)a);
    return d % elem ? 0 : (long long)(d / elem);
}

static size_t operand_bytes(void)
{
    return prec == MOE_PREC_FP32 ? sizeof(real) : sizeof(uint16_t);
}

/* Each group's two products as one strided batch of 2 (the two weights' operands and the
 * two outputs a fixed distance apart, as the model's buffers are); else two calls. */
extern "C" void cuda_grouped_matmul_forward_pair(real *out_a, real *out_b, const real *x,
                                                 const real *wa, const real *wb, const int *offsets,
                                                 int G, int I, int O)
{
    const void *wao = weight_operand(wa), *wbo = weight_operand(wb);
    const size_t MO = (size_t)offsets[G] * O;
    const int out16 = output16(out_a, MO, 0);
    const gemm_batch s = {2, stride_between(wao, wbo, operand_bytes()), 0,
                          stride_between(out_a, out_b, out16 ? sizeof(uint16_t) : sizeof(real))};
    if (s.sa == 0 || s.sc == 0 || out16 != output16(out_b, MO, 0)) {
        cuda_grouped_matmul_forward(out_a, x, wa, offsets, G, I, O);
        cuda_grouped_matmul_forward(out_b, x, wb, offsets, G, I, O);
        return;
    }
    const void *xo = rounded_operand(x, (size_t)offsets[G] * I, 0);
    for (int g = 0; g < G; g++) {
        const int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows > 0)
            grouped_add_pair(&batch, 1, 0, O, rows, I, at(wao, (size_t)g * O * I), I,
                             at(xo, (size_t)m0 * I), I, out_at(out_a, (size_t)m0 * O, out16), O, 0,
                             out16, s);
    }
    grouped_flush(&batch);
}

extern "C" void cuda_swiglu_forward(real *h, const real *a, const real *b, size_t n);

static long n_swiglu_epilogue; /* launches of the wgmma kernel with SwiGLU in its epilogue */

extern "C" long moe_cuda_swiglu_epilogue_launches(void) { return n_swiglu_epilogue; }

/* The pair, then SwiGLU (ops.h). With MOE_SWIGLU_EPILOGUE=1 (a trial's knob, read each
 * call), where the pair would run on the wgmma kernel (its forward class in
 * MOE_GROUPED_WGMMA_CLASSES) and out_a, out_b and h are marked as holding 16-bit values,
 * as the model's are: the kernel computes h in its epilogue from the rounded gate and up
 * values it stores (grouped_wgmma.cu), GW_SW groups a launch, so that SwiGLU's pass (which
 * reads both outputs back) goes. Else the two ops. */
extern "C" void cuda_grouped_matmul_forward_pair_swiglu(real *h, real *out_a, real *out_b,
                                                        const real *x, const real *wa,
                                                        const real *wb, const int *offsets, int G,
                                                        int I, int O)
{
    const size_t MO = (size_t)offsets[G] * O;
#if MOE_HAVE_SM90A
    int sms = 0;
    const char *classes = NULL;
    int o16 = 0;
    if (moe_cuda_env_is("MOE_SWIGLU_EPILOGUE", "1") &&
        (!(classes = getenv("MOE_GROUPED_WGMMA_CLASSES")) || (atoi(classes) & 1)) && MO > 0 &&
        (o16 = output16(out_a, MO, 0)) && output16(out_b, MO, 0) == o16 &&
        output16(h, MO, 0) == o16 && wgmma_grouped_on(&sms) && I % 8 == 0 && O % 8 == 0 &&
        aligned16(x) && aligned16(out_a) && aligned16(out_b) && aligned16(h)) {
        const void *xo = rounded_operand(x, (size_t)offsets[G] * I, 0);
        const void *wao = weight_operand(wa), *wbo = weight_operand(wb);
        static gw_args args;
        static const uint16_t *up_w[GW_SW];
        static void *up[GW_SW], *hh[GW_SW];
        const int bf16 = prec == MOE_PREC_BF16;
        int ok = aligned16(xo) && aligned16(wao) && aligned16(wbo);
        if (!ok)
            goto separate;
        MOE_CUDA_PROF_BEGIN("wgmma grouped GEMM, SwiGLU epilogue");
        args.count = 0;
        for (int g = 0; ok; g++) {
            if (g == G || args.count == GW_SW) { /* launch what is gathered */
                if (args.count > 0) {
                    ok = cuda_wgmma_grouped_swiglu(bf16, &args, up_w, up, hh, sms,
                                                   moe_cuda_stream());
                    n_wgmma++;
                    n_swiglu_epilogue++;
                }
                args.count = 0;
                if (g == G)
                    break;
            }
            const int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
            if (rows <= 0)
                continue;
            const int c = args.count++;
            gw_problem *p = &args.p[c];
            p->a = (const uint16_t *)at(xo, (size_t)m0 * I);
            p->b = (const uint16_t *)at(wao, (size_t)g * O * I);
            p->c = out_at(out_a, (size_t)m0 * O, o16);
            p->m = rows;
            p->n = O;
            p->k = I;
            p->lda = p->ldb = I;
            p->ldc = O;
            p->flags = GW_OUT16;
            up_w[c] = (const uint16_t *)at(wbo, (size_t)g * O * I);
            up[c] = out_at(out_b, (size_t)m0 * O, o16);
            hh[c] = out_at(h, (size_t)m0 * O, o16);
        }
        MOE_CUDA_PROF_END();
        if (!ok)
            MOE_CUDA_FAIL("the wgmma grouped GEMM with SwiGLU could not be launched");
        return;
    }
separate:
#endif
    cuda_grouped_matmul_forward_pair(out_a, out_b, x, wa, wb, offsets, G, I, O);
    cuda_swiglu_forward(h, out_a, out_b, MO);
}

/* dwa and dwb of each group as one strided batch of 2 (where both output gradients hold
 * their operands, so that neither is rounded into the one workspace), and dx of each group
 * as one problem of two products (dout_a wa + dout_b wb: one sum and one store on the
 * wgmma kernel; on cuBLAS dx_b's products are added after the batch). Else the two
 * backward calls. */
extern "C" void cuda_grouped_matmul_backward_pair(real *dx, real *dwa, real *dwb,
                                                  const real *dout_a, const real *dout_b,
                                                  const real *x, const real *wa, const real *wb,
                                                  const int *offsets, int G, int I, int O,
                                                  int write)
{
    const size_t M = (size_t)offsets[G], OI = (size_t)O * I;
    int bf16 = 0;
    const int in_place = prec == MOE_PREC_FP32 || (cuda_operand_in_place(dout_a, M * O, &bf16) &&
                                                   cuda_operand_in_place(dout_b, M * O, &bf16));
    const int dw_first = (write & MOE_WRITE_DW) != 0, dx_first = (write & MOE_WRITE_DX) != 0;
    int dwa16 = 0, dwb16 = 0;
    void *dwat = dwa ? dw_target(dwa, (size_t)G * OI, !dw_first, &dwa16) : NULL;
    void *dwbt = dwb ? dw_target(dwb, (size_t)G * OI, !dw_first, &dwb16) : NULL;
    const size_t dw_bytes = dwa16 ? sizeof(uint16_t) : sizeof(real);
    const gemm_batch s = {2, 0, stride_between(dout_a, dout_b, operand_bytes()),
                          stride_between(dwat, dwbt, dw_bytes)};
    if (!in_place || !dwa || !dwb || s.sb == 0 || s.sc == 0 || dwa16 != dwb16) {
        cuda_grouped_matmul_backward(dx, dwa, dout_a, x, wa, offsets, G, I, O, write);
        cuda_grouped_matmul_backward(dx, dwb, dout_b, x, wb, offsets, G, I, O,
                                     write & ~MOE_WRITE_DX);
        return;
    }
    const void *xo = rounded_operand(x, M * I, 0);
    const void *wao = dx ? weight_operand(wa) : NULL, *wbo = dx ? weight_operand(wb) : NULL;
    const int dx16 = output16(dx, M * I, 1); /* 0: dx_b's products add to it on cuBLAS */
    for (int g = 0; g < G; g++) {
        const int m0 = offsets[g], rows = offsets[g + 1] - offsets[g];
        if (rows <= 0) {
            if (dw_first) {
                zero_empty_run(dwat, dwa16, offsets, g, G, OI);
                zero_empty_run(dwbt, dwb16, offsets, g, G, OI);
            }
            continue;
        }
        const void *da = at(dout_a, (size_t)m0 * O), *db = at(dout_b, (size_t)m0 * O);
        if (dx)
            grouped_add_two(&batch, 0, 0, I, rows, O, at(wao, (size_t)g * OI), I, da, O, O,
                            at(wbo, (size_t)g * OI), db, dx + (size_t)m0 * I, I, !dx_first, dx16);
        grouped_add_pair(&batch, 0, 1, I, O, rows, at(xo, (size_t)m0 * I), I, da, O,
                         out_at(dwat, (size_t)g * OI, dwa16), I, !dw_first, dwa16, s);
    }
    grouped_flush(&batch);
}

/* ---- the bench's GEMM ceiling -------------------------------------------------------- */

static int cmp_float(const void *a, const void *b)
{
    const float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* C (n,n) fp32 = A B with n x n operands of the current precision (random values in
 * [-0.5, 0.5): fill_random.cuh), through the same cached cuBLASLt plans; median of 10
 * runs after 2 warm-ups, timed by CUDA events. */
extern "C" double cuda_gemm_rate(int n)
{
    const size_t nn = (size_t)n * n, eb = prec == MOE_PREC_FP32 ? 4 : 2;
    void *a = NULL, *b = NULL;
    real *c = NULL;
    cudaEvent_t ev[11] = {};
    double rate = 0.0;
    float ms[10];
    if (n <= 0 || !MOE_CUDA_OK(cudaMalloc(&a, eb * nn)) || !MOE_CUDA_OK(cudaMalloc(&b, eb * nn)) ||
        !MOE_CUDA_OK(cudaMalloc((void **)&c, sizeof(real) * nn)))
        goto done;
    for (int i = 0; i < 11; i++)
        if (!MOE_CUDA_OK(cudaEventCreate(&ev[i])))
            goto done;
    MOE_CUDA_LAUNCH(moe_fill_random_kernel, 1024, 256, 0, a, nn, 1u, operand_type(), 0.5f);
    MOE_CUDA_LAUNCH(moe_fill_random_kernel, 1024, 256, 0, b, nn, 2u, operand_type(), 0.5f);
    for (int w = 0; w < 2; w++)
        gemm(1, 0, n, n, n, a, n, b, n, c, n, 0);
    MOE_CUDA_OK(cudaEventRecord(ev[0], moe_cuda_stream()));
    for (int r = 0; r < 10; r++) {
        gemm(1, 0, n, n, n, a, n, b, n, c, n, 0);
        MOE_CUDA_OK(cudaEventRecord(ev[r + 1], moe_cuda_stream()));
    }
    if (!MOE_CUDA_OK(cudaEventSynchronize(ev[10])))
        goto done;
    for (int r = 0; r < 10; r++)
        if (!MOE_CUDA_OK(cudaEventElapsedTime(&ms[r], ev[r], ev[r + 1])))
            goto done;
    qsort(ms, 10, sizeof ms[0], cmp_float);
    if (ms[5] > 0)
        rate = 2.0 * (double)n * (double)nn / (1e-3 * ms[5]);
done:
    for (int i = 0; i < 11; i++)
        if (ev[i])
            cudaEventDestroy(ev[i]);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
    return rate;
}
