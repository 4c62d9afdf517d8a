/* tests/gpu/test_cuda_ops.c: every op of the "cuda" backend against the CPU reference
 * (moe_backend_cpu) on the same random inputs (never zeros).
 *
 * Outputs an op writes are poisoned (NaN, or -7 for ints) on both sides before the run;
 * outputs it accumulates into (+=) are pre-filled with the same random values on both
 * sides. A value passes when |gpu - ref| <= atol + rtol * |ref| (integers: exactly). The
 * first mismatches of a check print with their index; the end prints one line per op
 * with its worst absolute and relative errors, and the exit code is non-zero if any
 * check failed. Without a usable GPU it prints "SKIP: ..." and exits 77. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "util/rng.h"

#define SEED 20240611u
#define MAX_OPS 64
#define MAX_SHOWN 5
#define POISON_INT (-7)

static const moe_backend *cpu = &moe_backend_cpu, *gpu;

/* ---- results ------------------------------------------------------------------------- */

typedef struct {
    const char *op;
    double worst_abs, worst_rel;
    int checks, failed;
} op_result;

static op_result results[MAX_OPS];
static int n_results;
static op_result *cur;
static const char *cur_case;

static void begin(const char *op, const char *case_name)
{
    cur_case = case_name;
    for (int i = 0; i < n_results; i++)
        if (strcmp(results[i].op, op) == 0) {
            cur = &results[i];
            return;
        }
    if (n_results == MAX_OPS) {
        fprintf(stderr, "too many ops for the result table\n");
        exit(1);
    }
    cur = &results[n_results++];
    cur->op = op;
}

static void fail_now(const char *what)
{
    printf("FAIL %s [%s]: %s\n", cur->op, cur_case, what);
    cur->failed++;
}

static void note_error(double d, double ref)
{
    double rel = ref != 0.0 ? d / fabs(ref) : d;
    if (isnan(d))
        d = rel = INFINITY;
    if (d > cur->worst_abs)
        cur->worst_abs = d;
    if (rel > cur->worst_rel)
        cur->worst_rel = rel;
}

/* Compares n floats (cols > 1: printed as [row, col]); a NaN on both sides is equal (an
 * element neither side wrote). */
static void check_f(const char *what, const float *got, const float *ref, size_t n, size_t cols,
                    double atol, double rtol)
{
    size_t bad = 0;
    cur->checks++;
    for (size_t i = 0; i < n; i++) {
        double g = got[i], r = ref[i];
        double d = isnan(g) && isnan(r) ? 0.0 : fabs(g - r);
        note_error(d, r);
        if (d <= atol + rtol * fabs(r))
            continue;
        if (bad++ < MAX_SHOWN) {
            if (cols > 1)
                printf("  %s [%s] %s[%zu, %zu]: gpu %.9g ref %.9g (|d| %.3g)\n", cur->op, cur_case,
                       what, i / cols, i % cols, g, r, d);
            else
                printf("  %s [%s] %s[%zu]: gpu %.9g ref %.9g (|d| %.3g)\n", cur->op, cur_case, what,
                       i, g, r, d);
        }
    }
    if (bad) {
        printf("FAIL %s [%s] %s: %zu of %zu values differ\n", cur->op, cur_case, what, bad, n);
        cur->failed++;
    }
}

static void check_d(const char *what, const double *got, const double *ref, size_t n, double atol,
                    double rtol)
{
    size_t bad = 0;
    cur->checks++;
    for (size_t i = 0; i < n; i++) {
        double d = fabs(got[i] - ref[i]);
        note_error(d, ref[i]);
        if (d <= atol + rtol * fabs(ref[i]))
            continue;
        if (bad++ < MAX_SHOWN)
            printf("  %s [%s] %s[%zu]: gpu %.17g ref %.17g\n", cur->op, cur_case, what, i, got[i],
                   ref[i]);
    }
    if (bad) {
        printf("FAIL %s [%s] %s: %zu of %zu values differ\n", cur->op, cur_case, what, bad, n);
        cur->failed++;
    }
}

static void check_i(const char *what, const int32_t *got, const int32_t *ref, size_t n)
{
    size_t bad = 0;
    cur->checks++;
    for (size_t i = 0; i < n; i++) {
        if (got[i] == ref[i])
            continue;
        if (bad++ < MAX_SHOWN)
            printf("  %s [%s] %s[%zu]: gpu %d ref %d\n", cur->op, cur_case, what, i, got[i],
                   ref[i]);
    }
    if (bad) {
        printf("FAIL %s [%s] %s: %zu of %zu values differ\n", cur->op, cur_case, what, bad, n);
        cur->failed++;
        note_error(INFINITY, 1.0);
    }
}

static void check_i64(const char *what, const int64_t *got, const int64_t *ref, size_t n)
{
    size_t bad = 0;
    cur->checks++;
    for (size_t i = 0; i < n; i++) {
        if (got[i] == ref[i])
            continue;
        if (bad++ < MAX_SHOWN)
            printf("  %s [%s] %s[%zu]: gpu %lld ref %lld\n", cur->op, cur_case, what, i,
                   (long long)got[i], (long long)ref[i]);
    }
    if (bad) {
        printf("FAIL %s [%s] %s: %zu of %zu values differ\n", cur->op, cur_case, what, bad, n);
        cur->failed++;
        note_error(INFINITY, 1.0);
    }
}

/* ---- memory: host and device blocks of one case, freed together ---------------------- */

#define MAX_BLOCKS 256
static void *host_blocks[MAX_BLOCKS], *dev_blocks[MAX_BLOCKS];
static int n_host, n_dev;

/* Grouped calls and one-by-one GEMMs of the grouped matmuls so far (matmul.cu). */
void moe_cuda_grouped_counts(long *grouped_calls, long *single_gemms);

static void *hmem(size_t nbytes)
{
    void *p = malloc(nbytes ? nbytes : 1);
    if (!p || n_host == MAX_BLOCKS) {
        fprintf(stderr, "out of host memory (or blocks) in the test\n");
        exit(1);
    }
    return host_blocks[n_host++] = p;
}

static void *dmem(size_t nbytes)
{
    void *p = gpu->alloc(nbytes);
    if (!p || n_dev == MAX_BLOCKS) {
        fprintf(stderr, "cannot allocate %zu bytes on the GPU\n", nbytes);
        exit(1);
    }
    return dev_blocks[n_dev++] = p;
}

/* Frees the blocks taken since the marks (counts of blocks then). */
static void free_since(int host_mark, int dev_mark)
{
    for (int i = host_mark; i < n_host; i++)
        free(host_blocks[i]);
    for (int i = dev_mark; i < n_dev; i++)
        gpu->release(dev_blocks[i]);
    n_host = host_mark;
    n_dev = dev_mark;
}

static void free_all(void) { free_since(0, 0); }

/* A device copy of n bytes of host memory. */
static void *dev(const void *h, size_t nbytes)
{
    void *d = dmem(nbytes);
    if (nbytes)
        gpu->copy(d, h, nbytes, MOE_COPY_H2D);
    return d;
}

static void *host_of(const void *d, size_t nbytes)
{
    void *h = hmem(nbytes);
    if (nbytes)
        gpu->copy(h, d, nbytes, MOE_COPY_D2H);
    return h;
}

#define DEVF(h, n) ((float *)dev((h), sizeof(float) * (size_t)(n)))
#define DEVI(h, n) ((int32_t *)dev((h), sizeof(int32_t) * (size_t)(n)))
#define HOSTF(d, n) ((float *)host_of((d), sizeof(float) * (size_t)(n)))
#define HOSTI(d, n) ((int32_t *)host_of((d), sizeof(int32_t) * (size_t)(n)))

/* Waits for the GPU op just queued; a failure counts against the current op. */
static void gpu_done(void)
{
    if (gpu->sync() != MOE_OK)
        fail_now("the cuda backend reported an error");
}

/* ---- inputs -------------------------------------------------------------------------- */

static uint64_t next_stream = 1;

static float *frand(size_t n, double lo, double hi)
{
    float *x = hmem(sizeof(float) * n);
    uint64_t s = next_stream++;
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(lo + (hi - lo) * moe_rng_uniform(SEED, s, i));
    return x;
}

static float *fnan(size_t n)
{
    float *x = hmem(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        x[i] = NAN;
    return x;
}

/* uniform ints in [lo, hi) */
static int32_t *irand(size_t n, int lo, int hi)
{
    int32_t *x = hmem(sizeof(int32_t) * n);
    uint64_t s = next_stream++;
    for (size_t i = 0; i < n; i++)
        x[i] = lo + (int32_t)(moe_rng_u64(SEED, s, i) % (uint64_t)(hi - lo));
    return x;
}

static int32_t *ipoison(size_t n)
{
    int32_t *x = hmem(sizeof(int32_t) * n);
    for (size_t i = 0; i < n; i++)
        x[i] = POISON_INT;
    return x;
}

/* ---- tolerances ---------------------------------------------------------------------- */

#define EXACT 0.0, 0.0
#define TIGHT 1e-6, 1e-6 /* elementwise in double (fp32 mode), one rounding */
#define REDUCE 1e-6, 1e-5
/* fp32 GEMMs: both sides round a sum of k products, in different orders */
#define GEMM_K(k) (1e-5 * fmax(1.0, sqrt((k) / 128.0))), 1e-4
#define GEMM GEMM_K(0)
#define ATTN 2e-5, 1e-4

/* ---- elementwise, embedding ---------------------------------------------------------- */

static void test_add(size_t n, const char *name)
{
    begin("add_inplace", name);
    float *y = frand(n, -1, 1), *x = frand(n, -1, 1);
    float *dy = DEVF(y, n), *dx = DEVF(x, n);
    cpu->add_inplace(y, x, n);
    gpu->add_inplace(dy, dx, n);
    gpu_done();
    check_f("y", HOSTF(dy, n), y, n, 1, EXACT);
    free_all();
}

static void test_embedding(int N, int D, int V, const char *name)
{
    const size_t ND = (size_t)N * D, VD = (size_t)V * D;
    int32_t *tok = irand(N, 0, V);
    float *table = frand(VD, -1, 1);
    int32_t *dtok = DEVI(tok, N);

    begin("embedding_forward", name);
    float *out = fnan(ND), *dout = DEVF(out, ND);
    cpu->embedding_forward(out, tok, table, N, D);
    gpu->embedding_forward(dout, dtok, DEVF(table, VD), N, D);
    gpu_done();
    check_f("out", HOSTF(dout, ND), out, ND, D, EXACT);

    begin("embedding_backward", name);
    float *dtable = frand(VD, -1, 1), *g = frand(ND, -1, 1);
    float *ddtable = DEVF(dtable, VD);
    cpu->embedding_backward(dtable, g, tok, N, D, V);
    gpu->embedding_backward(ddtable, DEVF(g, ND), dtok, N, D, V);
    gpu_done();
    check_f("dtable", HOSTF(ddtable, VD), dtable, VD, D, TIGHT);
    free_all();
}

/* ---- rmsnorm
 * -------------------------------------------------------------------------------------- */

static void test_rmsnorm(int N, int D, const char *name)
{
    const size_t ND = (size_t)N * D;
    const float eps = 1e-5f;
    float *x = frand(ND, -2, 2), *w = frand(D, 0.5, 1.5);
    float *dx_ = DEVF(x, ND), *dw_ = DEVF(w, D);

    begin("rmsnorm_forward", name);
    float *out = fnan(ND), *rstd = fnan(N);
    float *dout = DEVF(out, ND), *drstd = DEVF(rstd, N);
    cpu->rmsnorm_forward(out, rstd, x, w, N, D, eps);
    gpu->rmsnorm_forward(dout, drstd, dx_, dw_, N, D, eps);
    gpu_done();
    check_f("out", HOSTF(dout, ND), out, ND, D, REDUCE);
    check_f("rstd", HOSTF(drstd, N), rstd, N, 1, REDUCE);

    begin("rmsnorm_backward", name);
    float *g = frand(ND, -1, 1), *dg = DEVF(g, ND), *drs = DEVF(rstd, N);
    /* both, dx only, dweight only; added to, then written over NaN (write: both, dx with
     * dweight added to, dx alone, dweight alone): NaN is never read */
    static const int writes[7] = {
        0, 0, 0, MOE_WRITE_DX | MOE_WRITE_DW, MOE_WRITE_DX, MOE_WRITE_DX, MOE_WRITE_DW};
    for (int variant = 0; variant < 7; variant++) {
        const int write = writes[variant];
        const int has_dx = variant != 2 && variant != 6, has_dw = variant != 1 && variant != 5;
        float *gx = has_dx ? (write & MOE_WRITE_DX ? fnan(ND) : frand(ND, -1, 1)) : NULL;
        float *gw = has_dw ? (write & MOE_WRITE_DW ? fnan(D) : frand(D, -1, 1)) : NULL;
        float *dgx = gx ? DEVF(gx, ND) : NULL, *dgw = gw ? DEVF(gw, D) : NULL;
        cpu->rmsnorm_backward(gx, gw, g, x, w, rstd, N, D, write, NULL);
        gpu->rmsnorm_backward(dgx, dgw, dg, dx_, dw_, drs, N, D, write, NULL);
        gpu_done();
        if (gx)
            check_f("dx", HOSTF(dgx, ND), gx, ND, D, REDUCE);
        if (gw)
            check_f("dweight", HOSTF(dgw, D), gw, D, 1, REDUCE);
    }
    /* dx_op: in fp32 a copy of dx; marked in bf16 and fp16, dx rounded: the device's own dx
     * rounded by the host's functions (ops.h), bit for bit. By shape, the fused kernel
     * writes them (D = 1024), or a rounding pass after the two-kernel form (D = 13, 4100). */
    static const moe_precision precs[3] = {MOE_PREC_FP32, MOE_PREC_BF16, MOE_PREC_FP16};
    static const char *prec_names[3] = {"fp32: a copy", "bf16, marked", "fp16, marked"};
    for (int p = 0; p < 3; p++) {
        char label[160];
        snprintf(label, sizeof label, "%s, dx_op %s", name, prec_names[p]);
        begin("rmsnorm_backward", label);
        if (gpu->set_precision(precs[p], NULL, 0, 0) != MOE_OK)
            fail_now("set_precision");
        float *gx = frand(ND, -1, 1), *gw = frand(D, -1, 1);
        float *dgx = DEVF(gx, ND), *dgw = DEVF(gw, D), *dop = DEVF(fnan(ND), ND);
        if (p && gpu->mark_operand(dop, ND) != MOE_OK)
            fail_now("mark_operand");
        cpu->rmsnorm_backward(gx, gw, g, x, w, rstd, N, D, MOE_WRITE_DW, NULL);
        gpu->rmsnorm_backward(dgx, dgw, dg, dx_, dw_, drs, N, D, MOE_WRITE_DW, dop);
        gpu_done();
        const float *hx = HOSTF(dgx, ND);
        check_f("dx", hx, gx, ND, D, REDUCE);
        check_f("dweight", HOSTF(dgw, D), gw, D, 1, REDUCE);
        int bad = 0, none = 0;
        if (p == 0) {
            bad = memcmp(HOSTF(dop, ND), hx, sizeof(float) * ND) != 0;
        } else {
            const uint16_t *h16 = (const uint16_t *)host_of(dop, sizeof(uint16_t) * ND);
            for (size_t i = 0; i < ND; i++)
                bad += h16[i] != (p == 1 ? moe_bf16_round(hx[i]) : moe_fp16_round(hx[i]));
            if (gpu->mark_operand(dop, 0) != MOE_OK)
                fail_now("mark_operand (removing)");
        }
        check_i("dx_op: dx, as its GEMM operand", &bad, &none, 1);
    }
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
    free_all();
}

/* ---- matmul
 * ---------------------------------------------------------------------------------------- */

static void test_matmul(int N, int I, int O, const char *name)
{
    const size_t NI = (size_t)N * I, OI = (size_t)O * I, NO = (size_t)N * O;
    float *x = frand(NI, -0.5, 0.5), *w = frand(OI, -0.5, 0.5);
    float *dx_ = DEVF(x, NI), *dw_ = DEVF(w, OI);

    begin("matmul_forward", name);
    float *out = fnan(NO), *dout = DEVF(out, NO);
    cpu->matmul_forward(out, x, w, N, I, O);
    gpu->matmul_forward(dout, dx_, dw_, N, I, O);
    gpu_done();
    check_f("out", HOSTF(dout, NO), out, NO, O, GEMM_K(I));

    begin("matmul_forward_batch", name);
    { /* three products of x, the weights w, w + 1, w + 2 (O x I apart), outputs NO + 8 apart */
        const size_t S = NO + 8;
        float *wb = frand(3 * OI, -0.5, 0.5), *ref = fnan(3 * S);
        float *dref = DEVF(ref, 3 * S);
        cpu->matmul_forward_batch(ref, S, x, wb, 3, N, I, O);
        gpu->matmul_forward_batch(dref, S, dx_, DEVF(wb, 3 * OI), 3, N, I, O);
        gpu_done();
        float *got = HOSTF(dref, 3 * S);
        for (int c = 0; c < 3; c++) {
            float *one = fnan(NO);
            cpu->matmul_forward(one, x, wb + c * OI, N, I, O);
            check_f("out", got + c * S, one, NO, O, GEMM_K(I));
        }
        float nan_gap[2][8]; /* 1 where a gap value is still NaN: the GPU's and the CPU's */
        for (int i = 0; i < 8; i++) {
            nan_gap[0][i] = isnan(got[NO + i]) && isnan(got[S + NO + i]);
            nan_gap[1][i] = isnan(ref[NO + i]) && isnan(ref[S + NO + i]);
        }
        const float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
        check_f("gaps untouched", nan_gap[0], ones, 8, 8, EXACT);
        check_f("gaps untouched (cpu)", nan_gap[1], ones, 8, 8, EXACT);
    }

    begin("matmul_forward_add", name);
    { /* out = base + x W^T: into a buffer of NaN, and in place over base */
        float *base = frand(NO, -1, 1), *ref = fnan(NO);
        float *dbase = DEVF(base, NO), *dsum = DEVF(fnan(NO), NO), *din = DEVF(base, NO);
        cpu->matmul_forward_add(ref, base, x, w, N, I, O);
        gpu->matmul_forward_add(dsum, dbase, dx_, dw_, N, I, O);
        gpu->matmul_forward_add(din, din, dx_, dw_, N, I, O);
        gpu_done();
        check_f("base + out", HOSTF(dsum, NO), ref, NO, O, GEMM_K(I));
        check_f("base + out in place", HOSTF(din, NO), HOSTF(dsum, NO), NO, O, EXACT);
    }

    begin("matmul_backward", name);
    float *g = frand(NO, -0.5, 0.5), *dg = DEVF(g, NO);
    for (int variant = 0; variant < 3; variant++) { /* both, dx only, dw only */
        float *gx = variant != 2 ? frand(NI, -1, 1) : NULL;
        float *gw = variant != 1 ? frand(OI, -1, 1) : NULL;
        float *dgx = gx ? DEVF(gx, NI) : NULL, *dgw = gw ? DEVF(gw, OI) : NULL;
        cpu->matmul_backward(gx, gw, g, x, w, N, I, O, 0);
        gpu->matmul_backward(dgx, dgw, dg, dx_, dw_, N, I, O, 0);
        gpu_done();
        if (gx)
            check_f("dx", HOSTF(dgx, NI), gx, NI, I, GEMM_K(O));
        if (gw)
            check_f("dw", HOSTF(dgw, OI), gw, OI, I, GEMM_K(N));
    }
    { /* written (MOE_WRITE_DX, MOE_WRITE_DW): the GPU's gradients start as NaN */
        float *gx = frand(NI, -1, 1), *gw = frand(OI, -1, 1);
        float *dgx = DEVF(fnan(NI), NI), *dgw = DEVF(fnan(OI), OI);
        cpu->matmul_backward(gx, gw, g, x, w, N, I, O, MOE_WRITE_DX | MOE_WRITE_DW);
        gpu->matmul_backward(dgx, dgw, dg, dx_, dw_, N, I, O, MOE_WRITE_DX | MOE_WRITE_DW);
        gpu_done();
        check_f("dx written", HOSTF(dgx, NI), gx, NI, I, GEMM_K(O));
        check_f("dw written", HOSTF(dgw, OI), gw, OI, I, GEMM_K(N));
    }
    free_all();
}

/* Many shapes, more than the cuBLASLt plan cache holds (it is flushed and refilled). */
static void test_matmul_shapes(int shapes, const char *name)
{
    begin("matmul_forward", name);
    const int I = 3, O = 2;
    float *w = frand((size_t)O * I, -0.5, 0.5), *dw_ = DEVF(w, (size_t)O * I);
    for (int N = 1; N <= shapes; N++) {
        const int host_mark = n_host, dev_mark = n_dev;
        float *x = frand((size_t)N * I, -0.5, 0.5), *out = fnan((size_t)N * O);
        float *dout = DEVF(out, (size_t)N * O);
        cpu->matmul_forward(out, x, w, N, I, O);
        gpu->matmul_forward(dout, DEVF(x, (size_t)N * I), dw_, N, I, O);
        gpu_done();
        check_f("out", HOSTF(dout, (size_t)N * O), out, (size_t)N * O, O, GEMM);
        free_since(host_mark, dev_mark);
    }
    free_all();
}

long moe_cuda_gemm_tuned(long *other);

/* A GEMM plan's candidates timed (the default) give the heuristic first's bits (untimed,
 * MOE_GEMM_TUNE=0) in each form the model calls: forward, forward with a
 * base added, the input and weight gradients added to; in a 16-bit precision (weights
 * in the shadow) cuBLASLt offers several candidates, so some plan must be timed. */
static void test_gemm_tune(int N, int I, int O, moe_precision p, const char *name)
{
    begin("matmul_tuned", name);
    const size_t NI = (size_t)N * I, OI = (size_t)O * I, NO = (size_t)N * O;
    float *x = frand(NI, -1, 1), *w = frand(OI, -0.5, 0.5), *base = frand(NO, -1, 1);
    float *g = frand(NO, -1, 1), *gx = frand(NI, -1, 1), *gw = frand(OI, -1, 1);
    float *dw_ = DEVF(w, OI);
    const int p16 = p != MOE_PREC_FP32;
    if (gpu->set_precision(p, p16 ? dw_ : NULL, p16 ? OI : 0, NI > NO ? NI : NO) != MOE_OK ||
        gpu->refresh_shadow() != MOE_OK) {
        fail_now("set_precision");
        return;
    }
    float *got[2][4];
    const long tuned0 = moe_cuda_gemm_tuned(NULL);
    long tuned1 = 0;
    for (int t = 0; t < 2; t++) {
        if (t == 0 && setenv("MOE_GEMM_TUNE", "0", 1) != 0)
            fail_now("setenv MOE_GEMM_TUNE");
        if (t == 1)
            unsetenv("MOE_GEMM_TUNE");
        float *dout = DEVF(fnan(NO), NO), *dsum = DEVF(fnan(NO), NO);
        float *dgx = DEVF(gx, NI), *dgw = DEVF(gw, OI), *dx_ = DEVF(x, NI);
        gpu->matmul_forward(dout, dx_, dw_, N, I, O);
        gpu->matmul_forward_add(dsum, DEVF(base, NO), dx_, dw_, N, I, O);
        gpu->matmul_backward(dgx, dgw, DEVF(g, NO), dx_, dw_, N, I, O, 0);
        gpu_done();
        got[t][0] = HOSTF(dout, NO);
        got[t][1] = HOSTF(dsum, NO);
        got[t][2] = HOSTF(dgx, NI);
        got[t][3] = HOSTF(dgw, OI);
        if (t == 0)
            tuned1 = moe_cuda_gemm_tuned(NULL);
    }
    unsetenv("MOE_GEMM_TUNE");
    long other = 0;
    const long tuned2 = moe_cuda_gemm_tuned(&other);
    if (tuned1 != tuned0)
        fail_now("MOE_GEMM_TUNE=0 timed a plan's candidates");
    if (p16 && N >= 4096 && tuned2 == tuned1) /* several candidates at this size */
        fail_now("no plan's candidates were timed");
    printf("  matmul_tuned [%s]: %ld plans timed (%ld in all keep another candidate than the "
           "first)\n",
           name, tuned2 - tuned1, other);
    check_f("out", got[1][0], got[0][0], NO, O, EXACT);
    check_f("base + out", got[1][1], got[0][1], NO, O, EXACT);
    check_f("dx", got[1][2], got[0][2], NI, I, EXACT);
    check_f("dw", got[1][3], got[0][3], OI, I, EXACT);
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
    free_all();
}

/* rows: rows of each of the G groups (zeros allowed). */
static void test_grouped(int G, const int *rows, int I, int O, const char *name)
{
    int *offsets = hmem(sizeof(int) * (G + 1));
    offsets[0] = 0;
    for (int g = 0; g < G; g++)
        offsets[g + 1] = offsets[g] + rows[g];
    const int M = offsets[G];
    const size_t MI = (size_t)M * I, MO = (size_t)M * O, GOI = (size_t)G * O * I;
    float *x = frand(MI, -0.5, 0.5), *w = frand(GOI, -0.5, 0.5);
    float *dx_ = DEVF(x, MI), *dw_ = DEVF(w, GOI);

    begin("grouped_matmul_forward", name);
    float *out = fnan(MO), *dout = DEVF(out, MO);
    cpu->grouped_matmul_forward(out, x, w, offsets, G, I, O);
    gpu->grouped_matmul_forward(dout, dx_, dw_, offsets, G, I, O);
    gpu_done();
    check_f("out", HOSTF(dout, MO), out, MO, O, GEMM_K(I));

    begin("grouped_matmul_backward", name);
    float *g = frand(MO, -0.5, 0.5), *dg = DEVF(g, MO);
    for (int variant = 0; variant < 3; variant++) { /* both, dw only, both written over NaN */
        const int write = variant == 2 ? MOE_WRITE_DW | MOE_WRITE_DX : 0;
        float *gx = variant == 1 ? NULL : variant == 2 ? fnan(MI) : frand(MI, -1, 1);
        float *gw = variant == 2 ? fnan(GOI) : frand(GOI, -1, 1);
        float *dgx = gx ? DEVF(gx, MI) : NULL, *dgw = DEVF(gw, GOI);
        cpu->grouped_matmul_backward(gx, gw, g, x, w, offsets, G, I, O, write);
        gpu->grouped_matmul_backward(dgx, dgw, dg, dx_, dw_, offsets, G, I, O, write);
        gpu_done();
        if (gx)
            check_f("dx", HOSTF(dgx, MI), gx, MI, I, GEMM_K(O));
        /* whole dw: an empty group's slice must be untouched on both sides */
        check_f("dw", HOSTF(dgw, GOI), gw, GOI, I, GEMM_K(M));
    }

    /* the pair: a second weight and output gradient; outputs and gradients one buffer */
    begin("grouped_matmul_forward_pair", name);
    float *w2 = frand(GOI, -0.5, 0.5), *pw = hmem(sizeof(float) * 2 * GOI);
    memcpy(pw, w, sizeof(float) * GOI);
    memcpy(pw + GOI, w2, sizeof(float) * GOI);
    float *dpw = DEVF(pw, 2 * GOI), *pout = fnan(2 * MO), *dpout = DEVF(pout, 2 * MO);
    cpu->grouped_matmul_forward_pair(pout, pout + MO, x, pw, pw + GOI, offsets, G, I, O);
    gpu->grouped_matmul_forward_pair(dpout, dpout + MO, dx_, dpw, dpw + GOI, offsets, G, I, O);
    gpu_done();
    check_f("out", HOSTF(dpout, 2 * MO), pout, 2 * MO, O, GEMM_K(I));

    /* and SwiGLU of it: h, then the two outputs, in one buffer over NaN */
    begin("grouped_matmul_forward_pair_swiglu", name);
    float *ph = fnan(3 * MO), *dph = DEVF(ph, 3 * MO);
    cpu->grouped_matmul_forward_pair_swiglu(ph, ph + MO, ph + 2 * MO, x, pw, pw + GOI, offsets, G,
                                            I, O);
    gpu->grouped_matmul_forward_pair_swiglu(dph, dph + MO, dph + 2 * MO, dx_, dpw, dpw + GOI,
                                            offsets, G, I, O);
    gpu_done();
    check_f("h, out a, out b", HOSTF(dph, 3 * MO), ph, 3 * MO, O, GEMM_K(I));

    begin("grouped_matmul_backward_pair", name);
    float *pg = frand(2 * MO, -0.5, 0.5), *dpg = DEVF(pg, 2 * MO);
    for (int variant = 0; variant < 2; variant++) { /* added to; written over NaN */
        const int write = variant ? MOE_WRITE_DW | MOE_WRITE_DX : 0;
        float *gx = variant ? fnan(MI) : frand(MI, -1, 1);
        float *gw = variant ? fnan(2 * GOI) : frand(2 * GOI, -1, 1);
        float *dgx = DEVF(gx, MI), *dgw = DEVF(gw, 2 * GOI);
        cpu->grouped_matmul_backward_pair(gx, gw, gw + GOI, pg, pg + MO, x, pw, pw + GOI, offsets,
                                          G, I, O, write);
        gpu->grouped_matmul_backward_pair(dgx, dgw, dgw + GOI, dpg, dpg + MO, dx_, dpw, dpw + GOI,
                                          offsets, G, I, O, write);
        gpu_done();
        check_f("dx", HOSTF(dgx, MI), gx, MI, I, GEMM_K(2 * O));
        check_f("dw", HOSTF(dgw, 2 * GOI), gw, 2 * GOI, I, GEMM_K(M));
    }
    free_all();
}

/* ---- swiglu, rope
 * ------------------------------------------------------------------------------------ */

static void test_swiglu(size_t n, const char *name)
{
    float *a = frand(n, -4, 4), *b = frand(n, -2, 2);
    float *da_ = DEVF(a, n), *db_ = DEVF(b, n);

    begin("swiglu_forward", name);
    float *h = fnan(n), *dh = DEVF(h, n);
    cpu->swiglu_forward(h, a, b, n);
    gpu->swiglu_forward(dh, da_, db_, n);
    gpu_done();
    check_f("h", HOSTF(dh, n), h, n, 1, TIGHT);

    begin("swiglu_backward", name);
    float *g = frand(n, -1, 1), *dg = DEVF(g, n);
    for (int variant = 0; variant < 3; variant++) { /* both, da only, db only */
        float *ga = variant != 2 ? frand(n, -1, 1) : NULL;
        float *gb = variant != 1 ? frand(n, -1, 1) : NULL;
        float *dga = ga ? DEVF(ga, n) : NULL, *dgb = gb ? DEVF(gb, n) : NULL;
        cpu->swiglu_backward(ga, gb, g, a, b, n);
        gpu->swiglu_backward(dga, dgb, dg, da_, db_, n);
        gpu_done();
        if (ga)
            check_f("da", HOSTF(dga, n), ga, n, 1, TIGHT);
        if (gb)
            check_f("db", HOSTF(dgb, n), gb, n, 1, TIGHT);
    }
    free_all();
}

static void test_rope(int B, int T, int H, int Hd, double theta, const char *name)
{
    const size_t nt = (size_t)T * (Hd / 2), nx = (size_t)B * T * H * Hd;

    begin("rope_tables", name);
    float *c = fnan(nt), *s = fnan(nt), *dc = DEVF(c, nt), *ds = DEVF(s, nt);
    cpu->rope_tables(c, s, T, Hd, theta);
    gpu->rope_tables(dc, ds, T, Hd, theta);
    gpu_done();
    check_f("cos", HOSTF(dc, nt), c, nt, Hd / 2, 2e-7, 1e-6);
    check_f("sin", HOSTF(ds, nt), s, nt, Hd / 2, 2e-7, 1e-6);

    /* the reference tables for both, so the rotation alone is compared */
    float *rc = DEVF(c, nt), *rs = DEVF(s, nt);
    for (int dir = 0; dir < 2; dir++) {
        begin(dir == 0 ? "rope_forward" : "rope_backward", name);
        float *x = frand(nx, -1, 1), *dx = DEVF(x, nx);
        if (dir == 0) {
            cpu->rope_forward(x, c, s, B, T, H, Hd);
            gpu->rope_forward(dx, rc, rs, B, T, H, Hd);
        } else {
            cpu->rope_backward(x, c, s, B, T, H, Hd);
            gpu->rope_backward(dx, rc, rs, B, T, H, Hd);
        }
        gpu_done();
        check_f("x", HOSTF(dx, nx), x, nx, Hd, 1e-7, 1e-6);
    }
    begin("rope_backward_qkv", name);
    float *g[3], *dg[3], *y = fnan(3 * nx), *dy = DEVF(y, 3 * nx);
    for (int a = 0; a < 3; a++) {
        g[a] = frand(nx, -1, 1);
        dg[a] = DEVF(g[a], nx);
    }
    cpu->rope_backward_qkv(y, g[0], g[1], g[2], c, s, B, T, H, Hd);
    gpu->rope_backward_qkv(dy, dg[0], dg[1], dg[2], rc, rs, B, T, H, Hd);
    gpu_done();
    check_f("dqkv", HOSTF(dy, 3 * nx), y, 3 * nx, 3 * H * Hd, 1e-7, 1e-6);
    free_all();
}

/* ---- attention ----------------------------------------------------------------------- */

static void test_attention(int B, int T, int H, int Hd, double amp, const char *name)
{
    const size_t n = (size_t)B * T * H * Hd, nl = (size_t)B * H * T;
    float *q = frand(n, -amp, amp), *k = frand(n, -amp, amp), *v = frand(n, -1, 1);
    float *dq_ = DEVF(q, n), *dk_ = DEVF(k, n), *dv_ = DEVF(v, n);

    begin("attention_forward", name);
    float *out = fnan(n), *lse = fnan(nl), *dout = DEVF(out, n), *dlse = DEVF(lse, nl);
    cpu->attention_forward(out, lse, q, k, v, B, T, H, Hd);
    gpu->attention_forward(dout, dlse, dq_, dk_, dv_, B, T, H, Hd);
    gpu_done();
    check_f("out", HOSTF(dout, n), out, n, (size_t)H * Hd, ATTN);
    check_f("lse", HOSTF(dlse, nl), lse, nl, T, ATTN);

    begin("attention_backward", name);
    /* the reference's out and lse as the saved activations of both */
    float *g = frand(n, -1, 1), *dg = DEVF(g, n), *rout = DEVF(out, n), *rlse = DEVF(lse, nl);
    for (int variant = 0; variant < 3; variant++) { /* all, dk + dv only, dq + dv only */
        float *gq = variant != 1 ? frand(n, -1, 1) : NULL;
        float *gk = variant != 2 ? frand(n, -1, 1) : NULL;
        float *gv = frand(n, -1, 1);
        /* the GPU's outputs start as NaNs: the op overwrites them (the CPU's, random) */
        float *dgq = gq ? DEVF(fnan(n), n) : NULL, *dgk = gk ? DEVF(fnan(n), n) : NULL;
        float *dgv = DEVF(fnan(n), n);
        cpu->attention_backward(gq, gk, gv, g, out, lse, q, k, v, B, T, H, Hd);
        gpu->attention_backward(dgq, dgk, dgv, dg, rout, rlse, dq_, dk_, dv_, B, T, H, Hd);
        gpu_done();
        if (gq)
            check_f("dq", HOSTF(dgq, n), gq, n, (size_t)H * Hd, ATTN);
        if (gk)
            check_f("dk", HOSTF(dgk, n), gk, n, (size_t)H * Hd, ATTN);
        check_f("dv", HOSTF(dgv, n), gv, n, (size_t)H * Hd, ATTN);
    }
    if (Hd % 2 == 0) {
        begin("attention_backward_qkv", name);
        const size_t nt = (size_t)T * (Hd / 2);
        float *c = fnan(nt), *s = fnan(nt);
        cpu->rope_tables(c, s, T, Hd, 10000.0);
        float *y = fnan(3 * n), *dy = DEVF(y, 3 * n), *rc = DEVF(c, nt), *rs = DEVF(s, nt);
        float *sc[3], *dsc[3]; /* the op's scratch */
        for (int a = 0; a < 3; a++) {
            sc[a] = frand(n, -1, 1);
            dsc[a] = DEVF(fnan(n), n);
        }
        cpu->attention_backward_qkv(y, sc[0], sc[1], sc[2], g, out, lse, q, k, v, c, s, B, T, H,
                                    Hd);
        gpu->attention_backward_qkv(dy, dsc[0], dsc[1], dsc[2], dg, rout, rlse, dq_, dk_, dv_, rc,
                                    rs, B, T, H, Hd);
        gpu_done();
        check_f("dqkv", HOSTF(dy, 3 * n), y, 3 * n, 3 * (size_t)H * Hd, ATTN);
    }
    free_all();
}

/* ---- router -------------------------------------------------------------------------- */

/* quantized: logits on a grid of 0.5, so probabilities tie exactly and the tie rule
 * (lower index first) decides. */
static void test_router(int N, int E, int K, int renorm, int quantized, const char *name)
{
    const size_t NE = (size_t)N * E, NK = (size_t)N * K;
    float *logits = frand(NE, -3, 3);
    if (quantized) {
        int32_t *qv = irand(NE, -2, 3);
        for (size_t i = 0; i < NE; i++)
            logits[i] = 0.5f * (float)qv[i];
    }

    begin("router_forward", name);
    float *probs = fnan(NE), *lse = fnan(N), *w = fnan(NK);
    int32_t *idx = ipoison(NK);
    float *dprobs_ = DEVF(probs, NE), *dlse = DEVF(lse, N), *dw_ = DEVF(w, NK);
    int32_t *didx = DEVI(idx, NK);
    const size_t np = router_aux_part_len(N, E);
    double *part = hmem(sizeof(double) * np), *dpart = dmem(sizeof(double) * np);
    cpu->router_forward(probs, lse, idx, w, part, logits, N, E, K, renorm);
    gpu->router_forward(dprobs_, dlse, didx, dw_, dpart, DEVF(logits, NE), N, E, K, renorm);
    gpu_done();
    check_f("probs", HOSTF(dprobs_, NE), probs, NE, E, TIGHT);
    check_f("lse", HOSTF(dlse, N), lse, N, 1, TIGHT);
    check_i("idx", HOSTI(didx, NK), idx, NK);
    check_f("w", HOSTF(dw_, NK), w, NK, K, TIGHT);

    /* the reference's outputs as the inputs of the backward ops */
    float *rprobs = DEVF(probs, NE), *rlse = DEVF(lse, N);
    int32_t *ridx = DEVI(idx, NK);

    begin("router_topk_backward", name);
    float *gw = frand(NK, -1, 1), *dp = frand(NE, -1, 1), *ddp = DEVF(dp, NE);
    cpu->router_topk_backward(dp, gw, probs, idx, N, E, K, renorm);
    gpu->router_topk_backward(ddp, DEVF(gw, NK), rprobs, ridx, N, E, K, renorm);
    gpu_done();
    check_f("dprobs", HOSTF(ddp, NE), dp, NE, E, REDUCE);

    begin("softmax_backward", name);
    float *gp = frand(NE, -1, 1), *dl = frand(NE, -1, 1), *ddl = DEVF(dl, NE);
    cpu->softmax_backward(dl, gp, probs, N, E);
    gpu->softmax_backward(ddl, DEVF(gp, NE), rprobs, N, E);
    gpu_done();
    check_f("dlogits", HOSTF(ddl, NE), dl, NE, E, REDUCE);

    begin("router_aux_partials", name);
    int64_t *counts = hmem(sizeof(int64_t) * E), *gcounts = hmem(sizeof(int64_t) * E);
    double *psum = hmem(sizeof(double) * E), *gpsum = hmem(sizeof(double) * E);
    int32_t *c0 = irand(E, 0, 50);
    float *p0 = frand(E, 0, 10);
    for (int e = 0; e < E; e++) {
        counts[e] = gcounts[e] = c0[e];
        psum[e] = gpsum[e] = p0[e];
    }
    /* the partials router_forward wrote in the same kernel, added to counts and psum */
    double z = cpu->router_aux_partials(counts, psum, part, N, E);
    double gz = gpu->router_aux_partials(gcounts, gpsum, dpart, N, E);
    gpu_done();
    check_i64("counts", gcounts, counts, E);
    check_d("psum", gpsum, psum, E, 1e-12, 1e-12);
    check_d("sum lse^2", &gz, &z, 1, 1e-12, 1e-12);

    begin("router_aux_backward", name);
    const int64_t Ng = 3 * (int64_t)N + 1;
    for (int variant = 0; variant < 3; variant++) { /* both, dprobs only, dlogits only */
        float *ap = variant != 2 ? frand(NE, -1, 1) : NULL;
        float *al = variant != 1 ? frand(NE, -1, 1) : NULL;
        float *dap = ap ? DEVF(ap, NE) : NULL, *dal = al ? DEVF(al, NE) : NULL;
        cpu->router_aux_backward(ap, al, probs, lse, counts, Ng, N, E, K, 0.3, 0.05);
        gpu->router_aux_backward(dap, dal, rprobs, rlse, counts, Ng, N, E, K, 0.3, 0.05);
        gpu_done();
        if (ap)
            check_f("dprobs", HOSTF(dap, NE), ap, NE, E, TIGHT);
        if (al)
            check_f("dlogits", HOSTF(dal, NE), al, NE, E, TIGHT);
    }

    /* the whole backward, written over NaN: fused (E <= 256), then the 4 kernels, which
     * must give the same bits */
    begin("router_backward", name);
    float *rl = fnan(NE), *rp = fnan(NE), *rdw = frand(NK, -1, 1), *fused = NULL;
    cpu->router_backward(rl, rp, rdw, probs, idx, lse, counts, Ng, N, E, K, renorm, 0.3, 0.05);
    for (int unfused = 0; unfused < 2; unfused++) {
        float *drl = DEVF(fnan(NE), NE), *drp = DEVF(fnan(NE), NE);
        if (unfused && setenv("MOE_ROUTER_BACKWARD_UNFUSED", "1", 1) != 0)
            fail_now("setenv");
        gpu->router_backward(drl, drp, DEVF(rdw, NK), rprobs, ridx, rlse, counts, Ng, N, E, K,
                             renorm, 0.3, 0.05);
        gpu_done();
        unsetenv("MOE_ROUTER_BACKWARD_UNFUSED");
        float *got = HOSTF(drl, NE);
        check_f(unfused ? "dlogits (4 kernels)" : "dlogits", got, rl, NE, E, REDUCE);
        if (!unfused) {
            fused = got;
        } else if (memcmp(got, fused, sizeof(float) * NE) != 0) {
            printf("FAIL router_backward [%s]: the 4 kernels' bits differ from the fused's\n",
                   name);
            cur->failed++;
        }
    }
    free_all();
}

/* ---- routing plan, permute, combine -------------------------------------------------- */

enum { IDX_RANDOM, IDX_HOLES, IDX_SKEWED };

/* idx (N,K): random experts; HOLES: expert 3 never chosen and about one slot in six
 * without an expert (-1); SKEWED: most slots on expert 0 (capacity drops). Weights on a
 * grid of 1/4, so the capacity's tie rule decides often. */
static void make_assignments(int32_t **idx_out, float **w_out, int N, int E, int K, int mode)
{
    const size_t NK = (size_t)N * K;
    int32_t *idx = irand(NK, 0, E), *r = irand(NK, 0, 6);
    int32_t *wq = irand(NK, 1, 5);
    float *w = hmem(sizeof(float) * (NK ? NK : 1));
    for (size_t a = 0; a < NK; a++) {
        if (mode == IDX_HOLES) {
            if (idx[a] == 3 && E > 4)
                idx[a] = 4;
            if (r[a] == 0)
                idx[a] = -1;
        } else if (mode == IDX_SKEWED && r[a] < 4) {
            idx[a] = 0;
        }
        w[a] = 0.25f * (float)wq[a];
    }
    *idx_out = idx;
    *w_out = w;
}

static void test_route(int N, int E, int K, int group, int capacity, int mode, int D,
                       const char *name)
{
    const size_t NK = (size_t)N * K, ND = (size_t)N * D;
    int32_t *idx;
    float *w;
    make_assignments(&idx, &w, N, E, K, mode);
    int32_t *didx = DEVI(idx, NK);
    float *dw_ = DEVF(w, NK);

    begin("moe_route_plan", name);
    int *offsets = hmem(sizeof(int) * (E + 1)), *goffsets = hmem(sizeof(int) * (E + 1));
    for (int e = 0; e <= E; e++)
        offsets[e] = goffsets[e] = POISON_INT;
    int32_t *row_token = ipoison(NK), *row_slot = ipoison(NK), *slot_row = ipoison(NK);
    int *scratch = (int *)ipoison(NK);
    int32_t *drt = DEVI(row_token, NK), *drs = DEVI(row_slot, NK), *dsr = DEVI(slot_row, NK);
    int *dscratch = (int *)DEVI(scratch, NK);
    int M = cpu->moe_route_plan(offsets, row_token, row_slot, slot_row, scratch, idx, w, N, E, K,
                                group, capacity);
    int gM =
        gpu->moe_route_plan(goffsets, drt, drs, dsr, dscratch, didx, dw_, N, E, K, group, capacity);
    gpu_done();
    check_i("M", &gM, &M, 1);
    check_i("offsets", goffsets, offsets, E + 1);
    check_i("slot_row", HOSTI(dsr, NK), slot_row, NK);
    check_i("row_token", HOSTI(drt, NK), row_token, M);
    check_i("row_slot", HOSTI(drs, NK), row_slot, M);
    if (M != gM) {
        free_all();
        return;
    }

    begin("moe_route_plan, offsets not reported", name);
    int32_t *drt2 = DEVI(ipoison(NK), NK), *drs2 = DEVI(ipoison(NK), NK);
    int32_t *dsr2 = DEVI(ipoison(NK), NK);
    int *dscratch2 = (int *)DEVI(ipoison(NK + E + 1), NK + E + 1);
    int unreported =
        gpu->moe_route_plan(NULL, drt2, drs2, dsr2, dscratch2, didx, dw_, N, E, K, group, capacity);
    gpu_done();
    const int minus_one = -1;
    check_i("returned", &unreported, &minus_one, 1);
    check_i("slot_row", HOSTI(dsr2, NK), slot_row, NK);
    check_i("row_token", HOSTI(drt2, NK), row_token, M);
    check_i("row_slot", HOSTI(drs2, NK), row_slot, M);

    /* the moves, on the reference plan */
    const size_t MD = (size_t)M * D;
    int32_t *rt = DEVI(row_token, NK), *rs = DEVI(row_slot, NK);
    float *x = frand(ND, -1, 1), *dx_ = DEVF(x, ND);

    begin("moe_permute", name);
    float *out = fnan(MD), *dout = DEVF(out, MD);
    cpu->moe_permute(out, x, row_token, M, D);
    gpu->moe_permute(dout, dx_, rt, M, D);
    gpu_done();
    check_f("out", HOSTF(dout, MD), out, MD, D, EXACT);

    /* each twice: rows sorted by token (no inverse map), and gathered through slot_row */
    int32_t *sr = DEVI(slot_row, NK);
    float *g = frand(MD, -1, 1), *y = frand(ND, -1, 1), *eo = frand(MD, -1, 1);
    float *deo = DEVF(eo, MD);
    /* and each from three bases: the destination itself (added to), another buffer, none
     * (written: the GPU's destination starts as NaN) */
    static const char *bases[3] = {"added", "from a base", "written"};
    for (int gather = 0; gather < 2; gather++)
        for (int b = 0; b < 3; b++) {
            char what[64];
            begin("moe_permute_backward", name);
            float *gx = frand(ND, -1, 1), *base = frand(ND, -1, 1);
            float *dgx = DEVF(b == 2 ? fnan(ND) : gx, ND), *dbase = DEVF(base, ND);
            cpu->moe_permute_backward(gx,
                                      b == 0   ? gx
                                      : b == 1 ? base
                                               : NULL,
                                      g, row_token, M, D, NULL, N, 0, NULL);
            gpu->moe_permute_backward(dgx,
                                      b == 0   ? dgx
                                      : b == 1 ? dbase
                                               : NULL,
                                      DEVF(g, MD), rt, M, D, gather ? sr : NULL, N, K, NULL);
            gpu_done();
            snprintf(what, sizeof what, "dx (%s, %s)", gather ? "gathered" : "sorted", bases[b]);
            check_f(what, HOSTF(dgx, ND), gx, ND, D, EXACT);

            begin("moe_combine_forward", name);
            float *yc = hmem(sizeof(float) * ND);
            memcpy(yc, y, sizeof(float) * ND);
            float *dy = DEVF(b == 2 ? fnan(ND) : yc, ND);
            cpu->moe_combine_forward(yc,
                                     b == 0   ? yc
                                     : b == 1 ? base
                                              : NULL,
                                     eo, w, row_token, row_slot, M, D, K, NULL, N);
            gpu->moe_combine_forward(dy,
                                     b == 0   ? dy
                                     : b == 1 ? dbase
                                              : NULL,
                                     deo, dw_, rt, rs, M, D, K, gather ? sr : NULL, N);
            gpu_done();
            snprintf(what, sizeof what, "y (%s, %s)", gather ? "gathered" : "sorted", bases[b]);
            check_f(what, HOSTF(dy, ND), yc, ND, D, EXACT);
        }
    /* the gradient rows sent back, the tokens as the received rows: [sum of each one's
     * rows | its slot weights' gradient], rows sorted and gathered (the GPU's start as
     * NaN: every value written) */
    for (int gather = 0; gather < 2; gather++) {
        begin("moe_pack_grad_rows", name);
        const size_t nw = (size_t)N * (D + K);
        float *gw = frand(NK, -1, 1), *grow = fnan(nw), *dgrow = DEVF(fnan(nw), nw);
        cpu->moe_pack_grad_rows(grow, g, row_token, M, NULL, gw, N, D, K);
        gpu->moe_pack_grad_rows(dgrow, DEVF(g, MD), rt, M, gather ? sr : NULL, DEVF(gw, NK), N, D,
                                K);
        gpu_done();
        check_f(gather ? "rows (gathered)" : "rows (sorted)", HOSTF(dgrow, nw), grow, nw,
                (size_t)(D + K), EXACT);
    }

    begin("moe_combine_backward", name);
    float *gy = frand(ND, -1, 1), *dgy = DEVF(gy, ND);
    for (int variant = 0; variant < 3; variant++) { /* both, dexpert_out only, dw only */
        float *ge = variant != 2 ? frand(MD, -1, 1) : NULL;
        float *gw = variant != 1 ? frand(NK, -1, 1) : NULL;
        /* dexpert_out starts as NaNs on the GPU (overwritten), dw as the CPU's (added to) */
        float *dge = ge ? DEVF(fnan(MD), MD) : NULL, *dgw = gw ? DEVF(gw, NK) : NULL;
        cpu->moe_combine_backward(ge, gw, gy, eo, w, row_token, row_slot, M, D, K);
        gpu->moe_combine_backward(dge, dgw, dgy, deo, dw_, rt, rs, M, D, K);
        gpu_done();
        if (ge)
            check_f("dexpert_out", HOSTF(dge, MD), ge, MD, D, EXACT);
        if (gw)
            check_f("dw", HOSTF(dgw, NK), gw, NK, K, REDUCE);
    }
    free_all();
}

/* The permute backward with arbitrary sources: M rows naming tokens in any order, repeats. */
static void test_permute_backward_any(int N, int M, int D, const char *name)
{
    begin("moe_permute_backward", name);
    const size_t ND = (size_t)N * D, MD = (size_t)M * D;
    int32_t *rt = irand(M, 0, N);
    float *gx = frand(ND, -1, 1), *g = frand(MD, -1, 1), *dgx = DEVF(gx, ND);
    cpu->moe_permute_backward(gx, gx, g, rt, M, D, NULL, 0, 0, NULL);
    gpu->moe_permute_backward(dgx, dgx, DEVF(g, MD), DEVI(rt, M), M, D, NULL, 0, 0, NULL);
    gpu_done();
    check_f("dx", HOSTF(dgx, ND), gx, ND, D, EXACT);
    free_all();
}

/* ---- exchange packing
 * ------------------------------------------------------------------------------ */

/* ---- routing statistics -------------------------------------------------------------- */

/* idx with repeats and -1 holes (ids in [-1, E)), counts starting from random values. */
static void test_routing_stats(int N, int E, int K, int with_prev, const char *name)
{
    begin("routing_stats_count", name);
    const size_t NK = (size_t)N * K, EE = (size_t)E * E, n = 1 + E + 2 * EE;
    int32_t *idx = irand(NK, -1, E), *prev = irand(NK, -1, E);
    int64_t *ref = hmem(sizeof(int64_t) * n);
    int32_t *start = irand(n, 0, 1000);
    for (size_t i = 0; i < n; i++)
        ref[i] = start[i];
    int64_t *d = dev(ref, sizeof(int64_t) * n);
    cpu->routing_stats_count(ref, ref + 1, ref + 1 + E, with_prev ? ref + 1 + E + EE : NULL, idx,
                             with_prev ? prev : NULL, N, E, K);
    gpu->routing_stats_count(d, d + 1, d + 1 + E, with_prev ? d + 1 + E + EE : NULL, DEVI(idx, NK),
                             with_prev ? DEVI(prev, NK) : NULL, N, E, K);
    gpu_done();
    check_i64("tokens, load, coact, trans", host_of(d, sizeof(int64_t) * n), ref, n);
    free_all();
}

/* moe_permute_rows of n dispatch rows (format x16; host rows and their device copy) into
 * M = 2n + 3 expert rows of random order (repeats): the CPU's against the CPU's unpacked
 * tokens ux (n, D) permuted, bit for bit; the GPU's against the CPU's, into fp32 and, for
 * 16-bit rows, into a marked buffer of the rows' own precision (their 16-bit values). */
static void test_permute_rows(const char *rows, const char *drows, size_t rb, int x16, int n, int D,
                              const float *ux)
{
    static const char *forms[3] = {"fp32 rows", "bf16 rows", "fp16 rows"};
    begin("moe_permute_rows", forms[x16]);
    if (n <= 0)
        return;
    const int M = 2 * n + 3;
    const size_t MD = (size_t)M * D;
    int32_t *order = irand(M, 0, n), *dorder = DEVI(order, M);
    float *px = fnan(MD), *dpx = DEVF(fnan(MD), MD);
    cpu->moe_permute_rows(px, rows, rb, x16, order, M, D);
    int bad = 0, none = 0;
    for (int m = 0; m < M; m++)
        bad += memcmp(px + (size_t)m * D, ux + (size_t)order[m] * D, sizeof(float) * D) != 0;
    check_i("CPU: the unpacked tokens permuted", &bad, &none, 1);
    gpu->moe_permute_rows(dpx, drows, rb, x16, dorder, M, D);
    gpu_done();
    check_i("out (bits)", (const int32_t *)HOSTF(dpx, MD), (const int32_t *)px, MD);
    if (x16 == MOE_ROW_FP32)
        return;
    begin("moe_permute_rows",
          x16 == MOE_ROW_BF16 ? "bf16 rows, out marked" : "fp16 rows, out marked");
    if (gpu->set_precision(x16 == MOE_ROW_BF16 ? MOE_PREC_BF16 : MOE_PREC_FP16, NULL, 0, 0) !=
        MOE_OK)
        fail_now("set_precision");
    float *d16 = DEVF(fnan(MD), MD);
    if (gpu->mark_operand(d16, MD) != MOE_OK)
        fail_now("mark_operand");
    gpu->moe_permute_rows(d16, drows, rb, x16, dorder, M, D);
    gpu_done();
    const uint16_t *h16 = (const uint16_t *)host_of(d16, sizeof(uint16_t) * MD);
    bad = 0;
    for (int m = 0; m < M; m++) /* the row's own 16-bit values */
        bad += memcmp(h16 + (size_t)m * D, rows + (size_t)order[m] * rb, 2 * (size_t)D) != 0;
    check_i("out: the rows' 16-bit tokens", &bad, &none, 1);
    if (gpu->mark_operand(d16, 0) != MOE_OK)
        fail_now("mark_operand (removing)");
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
}

/* moe_pack_dispatch from an x marked as holding 16-bit values (format m16: the model's h2)
 * into rows of format x16: the rows' tokens are the marked values' bits where the formats
 * are one (the fill copies them), else those values widened and rounded to x16; the
 * reference packs the widened values. */
static void test_pack_marked(const float *xe, const int32_t *idx, const float *w,
                             const int32_t *slot_row, const int32_t *erank, const int32_t *elocal,
                             int N, int E, int D, int K, int P, int per, int x16, int m16)
{
    const int bf = m16 == MOE_ROW_BF16;
    char label[96];
    snprintf(label, sizeof label, "%s rows from a marked %s x%s",
             x16 == MOE_ROW_BF16 ? "bf16" : "fp16", bf ? "bf16" : "fp16",
             x16 == m16 ? " (its bits copied)" : "");
    begin("moe_pack_dispatch", label);
    if (gpu->set_precision(bf ? MOE_PREC_BF16 : MOE_PREC_FP16, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision");
    const size_t ND = (size_t)N * D, NK = (size_t)N * K, max_rows = (size_t)N * P + 1;
    float *xr = hmem(sizeof(float) * ND);   /* the marked values, widened: the reference's x */
    uint16_t *h = hmem(sizeof(float) * ND); /* the marked buffer: ND 16-bit values first */
    for (size_t i = 0; i < ND; i++) {
        h[i] = bf ? moe_bf16_round(xe[i]) : moe_fp16_round(xe[i]);
        xr[i] = bf ? moe_bf16_widen(h[i]) : moe_fp16_widen(h[i]);
    }
    float *dx = DEVF(h, ND);
    if (gpu->mark_operand(dx, ND) != MOE_OK)
        fail_now("mark_operand");
    const size_t rb = moe_dispatch_row_bytes(D, K, x16), tb = moe_dispatch_token_bytes(D, x16);
    const int nc = MOE_PACK_COUNTS(P, per);
    char *r = hmem(max_rows * rb), *dr = dev(r, max_rows * rb);
    int32_t *st = ipoison(max_rows), *dst = DEVI(st, max_rows);
    int *c = hmem(sizeof(int) * nc), *gc = gpu->alloc_host(sizeof(int) * nc);
    for (int i = 0; i < nc; i++)
        c[i] = gc[i] = POISON_INT;
    cpu->moe_pack_dispatch(r, st, NULL, c, xr, idx, w, slot_row, erank, elocal, N, D, K, P, per, rb,
                           x16);
    gpu->moe_pack_dispatch(dr, dst, NULL, gc, dx, DEVI(idx, NK), DEVF(w, NK), DEVI(slot_row, NK),
                           DEVI(erank, E), DEVI(elocal, E), N, D, K, P, per, rb, x16);
    gpu_done();
    check_i("counts", gc, c, nc);
    const int n = c[2 * P];
    check_i("send_token", HOSTI(dst, n), st, n);
    const char *g = host_of(dr, max_rows * rb);
    int bad = 0, none = 0;
    for (int i = 0; i < n; i++) { /* the token's 16-bit values, then w and lidx */
        bad += memcmp(g + (size_t)i * rb, r + (size_t)i * rb, (size_t)D * 2) != 0;
        bad += memcmp(g + (size_t)i * rb + tb, r + (size_t)i * rb + tb, (size_t)K * 8) != 0;
    }
    check_i("rows (16-bit tokens, weights, ids) identical", &bad, &none, 1);
    gpu->release_host(gc);
    if (gpu->mark_operand(dx, 0) != MOE_OK)
        fail_now("mark_operand (removing)");
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
}

static void test_exchange(int N, int E, int K, int P, int D, int capacity, const char *name)
{
    const size_t NK = (size_t)N * K;
    int32_t *idx;
    float *w;
    make_assignments(&idx, &w, N, E, K, IDX_SKEWED);
    /* the plan (slot_row, with drops) from the reference */
    int *offsets = hmem(sizeof(int) * (E + 1)), *scratch = hmem(sizeof(int) * (NK + 1));
    int32_t *row_token = ipoison(NK), *row_slot = ipoison(NK), *slot_row = ipoison(NK);
    cpu->moe_route_plan(offsets, row_token, row_slot, slot_row, scratch, idx, w, N, E, K, N,
                        capacity);
    int32_t *erank = hmem(sizeof(int32_t) * E), *elocal = hmem(sizeof(int32_t) * E);
    const int per = (E + P - 1) / P;
    for (int e = 0; e < E; e++) {
        erank[e] = e / per;
        elocal[e] = e % per;
    }
    const size_t row_bytes = ((size_t)(D + K) * 4 + (size_t)K * 4 + 7) & ~(size_t)7;
    const size_t max_rows = (size_t)N * P + 1, nbytes = max_rows * row_bytes;

    begin("moe_pack_dispatch", name);
    char *rows = hmem(nbytes), *grows;
    memset(rows, 0xAB, nbytes);
    char *drows = dev(rows, nbytes);
    int32_t *st = ipoison(max_rows), *dst = DEVI(st, max_rows);
    /* the counts: the reference's at once, the GPU's queued into pinned memory */
    const int nc = MOE_PACK_COUNTS(P, per);
    int *counts = hmem(sizeof(int) * nc), *gcounts = gpu->alloc_host(sizeof(int) * nc);
    for (int i = 0; i < nc; i++)
        counts[i] = gcounts[i] = POISON_INT;
    float *x = frand((size_t)N * D, -1, 1);
    int32_t *trows = ipoison((size_t)N * P), *dtrows = DEVI(trows, (size_t)N * P);
    cpu->moe_pack_dispatch(rows, st, trows, counts, x, idx, w, slot_row, erank, elocal, N, D, K, P,
                           per, row_bytes, MOE_ROW_FP32);
    gpu->moe_pack_dispatch(drows, dst, dtrows, gcounts, DEVF(x, (size_t)N * D), DEVI(idx, NK),
                           DEVF(w, NK), DEVI(slot_row, NK), DEVI(erank, E), DEVI(elocal, E), N, D,
                           K, P, per, row_bytes, MOE_ROW_FP32);
    const long mark = gpu->queue_mark();
    if (gpu->queue_wait(mark, NULL, NULL) != MOE_OK)
        fail_now("queue_wait after moe_pack_dispatch");
    check_i("counts (rows, assignments, total, per expert)", gcounts, counts, nc);
    gpu_done();
    const int n = counts[2 * P], gn = gcounts[2 * P];
    gpu->release_host(gcounts);
    if (gn != n) {
        free_all();
        return;
    }
    check_i("send_token", HOSTI(dst, n), st, n);
    check_i("token_rows", HOSTI(dtrows, (size_t)N * P), trows, (size_t)N * P);
    grows = host_of(drows, nbytes);
    for (int r = 0; r < n; r++) {
        const float *a = (const float *)(grows + r * row_bytes);
        const float *b = (const float *)(rows + r * row_bytes);
        check_f("row x", a, b, D, 1, EXACT);
        check_f("row w", a + D, b + D, K, 1, EXACT);
        check_i("row lidx", (const int32_t *)(a + D + K), (const int32_t *)(b + D + K), K);
    }

    /* rows NULL (the experts take the tokens at ep 1): the counts, send_token and
     * token_rows alone, the same as above */
    begin("moe_pack_dispatch counts only", name);
    int32_t *st0 = ipoison(max_rows), *dst0 = DEVI(st0, max_rows);
    int32_t *trows0 = ipoison((size_t)N * P), *dtrows0 = DEVI(trows0, (size_t)N * P);
    int *gcounts0 = gpu->alloc_host(sizeof(int) * nc);
    for (int i = 0; i < nc; i++)
        gcounts0[i] = POISON_INT;
    gpu->moe_pack_dispatch(NULL, dst0, dtrows0, gcounts0, NULL, DEVI(idx, NK), NULL,
                           DEVI(slot_row, NK), DEVI(erank, E), DEVI(elocal, E), N, D, K, P, per, 0,
                           MOE_ROW_BF16);
    if (gpu->queue_wait(gpu->queue_mark(), NULL, NULL) != MOE_OK)
        fail_now("queue_wait after moe_pack_dispatch (counts only)");
    check_i("counts", gcounts0, counts, nc);
    gpu->release_host(gcounts0);
    check_i("send_token", HOSTI(dst0, n), st, n);
    check_i("token_rows", HOSTI(dtrows0, (size_t)N * P), trows, (size_t)N * P);

    begin("moe_unpack_dispatch", name);
    float *ux = fnan((size_t)n * D), *uw = fnan((size_t)n * K);
    int32_t *ul = ipoison((size_t)n * K);
    float *dux = DEVF(ux, (size_t)n * D), *duw = DEVF(uw, (size_t)n * K);
    int32_t *dul = DEVI(ul, (size_t)n * K);
    cpu->moe_unpack_dispatch(ux, uw, ul, rows, n, D, K, row_bytes, MOE_ROW_FP32);
    gpu->moe_unpack_dispatch(dux, duw, dul, dev(rows, nbytes), n, D, K, row_bytes, MOE_ROW_FP32);
    gpu_done();
    check_f("x", HOSTF(dux, (size_t)n * D), ux, (size_t)n * D, D, EXACT);
    check_f("w", HOSTF(duw, (size_t)n * K), uw, (size_t)n * K, K, EXACT);
    check_i("lidx", HOSTI(dul, (size_t)n * K), ul, (size_t)n * K);

    /* the 16-bit token forms: the device rounds with __float2bfloat16_rn / __float2half_rn,
     * the host with its own functions (ops.h), so equal bits check both; the tokens
     * include values the half overflows on, its subnormals and ties */
    float *xe = frand((size_t)N * D, -1, 1);
    for (size_t i = 0; i < (size_t)N * D; i++)
        xe[i] *= i % 5 == 1 ? 1e5f : i % 5 == 2 ? 3e-6f : 1.0f;
    for (size_t i = 0; i + 3 < (size_t)N * D; i += 97) {
        xe[i] = 1.0f + 0x1p-11f; /* ties of fp16 and of bf16 */
        xe[i + 1] = 1.0f + 0x3p-8f;
        xe[i + 2] = 0x3p-25f;
        xe[i + 3] = 65520.0f;
    }
    for (int x16 = MOE_ROW_BF16; x16 <= MOE_ROW_FP16; x16++) {
        begin("moe_pack_dispatch", x16 == MOE_ROW_BF16 ? "bf16 tokens" : "fp16 tokens");
        const size_t rb = moe_dispatch_row_bytes(D, K, x16), tb = moe_dispatch_token_bytes(D, x16);
        char *r16 = hmem(max_rows * rb), *dr16 = dev(r16, max_rows * rb);
        int32_t *st16 = ipoison(max_rows), *dst16 = DEVI(st16, max_rows);
        int *c16 = hmem(sizeof(int) * nc), *gc16 = gpu->alloc_host(sizeof(int) * nc);
        cpu->moe_pack_dispatch(r16, st16, NULL, c16, xe, idx, w, slot_row, erank, elocal, N, D, K,
                               P, per, rb, x16);
        gpu->moe_pack_dispatch(dr16, dst16, NULL, gc16, DEVF(xe, (size_t)N * D), DEVI(idx, NK),
                               DEVF(w, NK), DEVI(slot_row, NK), DEVI(erank, E), DEVI(elocal, E), N,
                               D, K, P, per, rb, x16);
        gpu_done();
        check_i("counts", gc16, c16, nc);
        gpu->release_host(gc16);
        const char *g16 = host_of(dr16, max_rows * rb);
        int bad = 0, none = 0;
        for (int r = 0; r < n; r++) { /* the token's 16-bit values, then w and lidx */
            bad += memcmp(g16 + r * rb, r16 + r * rb, (size_t)D * 2) != 0;
            bad += memcmp(g16 + r * rb + tb, r16 + r * rb + tb, (size_t)K * 8) != 0;
        }
        check_i("rows (16-bit tokens, weights, ids) identical", &bad, &none, 1);
        begin("moe_unpack_dispatch", x16 == MOE_ROW_BF16 ? "bf16 tokens" : "fp16 tokens");
        float *hx = fnan((size_t)n * D), *dhx = DEVF(hx, (size_t)n * D);
        cpu->moe_unpack_dispatch(hx, uw, ul, r16, n, D, K, rb, x16);
        gpu->moe_unpack_dispatch(dhx, duw, dul, dr16, n, D, K, rb, x16);
        gpu_done();
        /* as bits: the overflowed ones are infinite */
        check_i("x (bits)", (const int32_t *)HOSTF(dhx, (size_t)n * D), (const int32_t *)hx,
                (size_t)n * D);
        check_f("w", HOSTF(duw, (size_t)n * K), uw, (size_t)n * K, K, EXACT);
        check_i("lidx", HOSTI(dul, (size_t)n * K), ul, (size_t)n * K);
        test_permute_rows(r16, dr16, rb, x16, n, D, hx);
        for (int m16 = MOE_ROW_BF16; m16 <= MOE_ROW_FP16; m16++)
            test_pack_marked(xe, idx, w, slot_row, erank, elocal, N, E, D, K, P, per, x16, m16);
    }
    test_permute_rows(rows, dev(rows, nbytes), row_bytes, MOE_ROW_FP32, n, D, ux);
    begin("moe_unpack_dispatch, x NULL", name);
    float *uw0 = fnan((size_t)n * K), *duw0 = DEVF(uw0, (size_t)n * K);
    int32_t *dul0 = DEVI(ipoison((size_t)n * K), (size_t)n * K);
    gpu->moe_unpack_dispatch(NULL, duw0, dul0, dev(rows, nbytes), n, D, K, row_bytes, MOE_ROW_FP32);
    gpu_done();
    check_f("w", HOSTF(duw0, (size_t)n * K), uw, (size_t)n * K, K, EXACT);
    check_i("lidx", HOSTI(dul0, (size_t)n * K), ul, (size_t)n * K);

    const size_t nw = (size_t)n * (D + K);
    float *srows = frand(nw, -1, 1);
    /* twice: rows sorted by token (no inverse map), and gathered through token_rows; the
     * forward's sums of the returned rows (moe_permute_backward) likewise */
    /* dx from the three bases of test_route's ops; dw written (the GPU's starts as NaN) */
    static const char *bases[3] = {"added", "from a base", "written"};
    const size_t nd = (size_t)N * D;
    for (int gather = 0; gather < 2; gather++)
        for (int b = 0; b < 3; b++) {
            char what[64];
            begin("moe_scatter_grad_rows", name);
            float *sdx = frand(nd, -1, 1), *sdw = frand(NK, -1, 1), *base = frand(nd, -1, 1);
            float *dsdx = DEVF(b == 2 ? fnan(nd) : sdx, nd), *dsdw = DEVF(fnan(NK), NK);
            float *dbase = DEVF(base, nd);
            cpu->moe_scatter_grad_rows(sdx, sdw,
                                       b == 0   ? sdx
                                       : b == 1 ? base
                                                : NULL,
                                       srows, st, n, D, K, NULL, N, 0);
            gpu->moe_scatter_grad_rows(dsdx, dsdw,
                                       b == 0   ? dsdx
                                       : b == 1 ? dbase
                                                : NULL,
                                       DEVF(srows, nw), DEVI(st, n), n, D, K,
                                       gather ? dtrows : NULL, N, P);
            gpu_done();
            snprintf(what, sizeof what, "dx (%s, %s)", gather ? "gathered" : "sorted", bases[b]);
            check_f(what, HOSTF(dsdx, nd), sdx, nd, D, EXACT);
            snprintf(what, sizeof what, "dw (%s, %s)", gather ? "gathered" : "sorted", bases[b]);
            check_f(what, HOSTF(dsdw, NK), sdw, NK, K, EXACT);

            /* and with xmid added after the rows (last), as the layer's output at ep > 1 */
            for (int with_last = 0; with_last < 2; with_last++) {
                begin("moe_permute_backward of returned rows", name);
                float *rx = frand(nd, -1, 1), *drx = DEVF(b == 2 ? fnan(nd) : rx, nd);
                float *ret = frand((size_t)n * D, -1, 1), *last = frand(nd, -1, 1);
                cpu->moe_permute_backward(rx,
                                          b == 0   ? rx
                                          : b == 1 ? base
                                                   : NULL,
                                          ret, st, n, D, NULL, N, 0, with_last ? last : NULL);
                gpu->moe_permute_backward(drx,
                                          b == 0   ? drx
                                          : b == 1 ? dbase
                                                   : NULL,
                                          DEVF(ret, (size_t)n * D), DEVI(st, n), n, D,
                                          gather ? dtrows : NULL, N, P,
                                          with_last ? DEVF(last, nd) : NULL);
                gpu_done();
                snprintf(what, sizeof what, "y (%s, %s%s)", gather ? "gathered" : "sorted",
                         bases[b], with_last ? ", + last" : "");
                check_f(what, HOSTF(drx, nd), rx, nd, D, EXACT);
            }
        }
    free_all();
}

/* ---- loss ---------------------------------------------------------------------------- */

/* A device copy of n floats, `off` floats into its block (off 1: not 16-byte aligned). */
static float *devf_at(const float *h, size_t n, int off)
{
    float *d = (float *)dmem(sizeof(float) * (n + (size_t)off)) + off;
    gpu->copy(d, h, sizeof(float) * n, MOE_COPY_H2D);
    return d;
}

/* Forward and backward in fp32 mode (double exponentials) and in fp16 mode (float ones),
 * the logits `loff` and dlogits `goff` floats past 16-byte alignment (a 1 takes the float
 * path where V % 4 == 0 would load float4). neg_inf: row 0 is -inf but at its target,
 * and in the other rows every fifth logit but the target is -inf. The backward overwrites
 * (dlogits poisoned on both sides); its in-place form (dlogits == logits) must give the
 * bits of the out-of-place one. */
static void test_cross_entropy(int N, int V, int loff, int goff, int neg_inf, const char *name)
{
    static char label[160];
    const size_t NV = (size_t)N * V;
    float *logits = frand(NV, -4, 4);
    int32_t *tg = irand(N, 0, V), *dtg = DEVI(tg, N);
    for (int n = 0; neg_inf && n < N; n++)
        for (int v = 0; v < V; v++)
            if (v != tg[n] && (n == 0 || v % 5 == 1))
                logits[(size_t)n * V + v] = -INFINITY;
    float *dlog_ = devf_at(logits, NV, loff);
    const float scale = 1.0f / (2.0f * (float)N);
    float *loss = fnan(N), *lse = fnan(N), *g = fnan(NV);
    cpu->cross_entropy_forward(loss, lse, logits, tg, N, V);
    cpu->cross_entropy_backward(g, logits, lse, tg, scale, N, V);
    float *dlse_ref = DEVF(lse, N);

    for (int mode = 0; mode < 2; mode++) {
        const int fp32 = mode == 0;
        snprintf(label, sizeof label, "%s, %s", name, fp32 ? "fp32" : "fp16 (float exp)");
        begin("cross_entropy_forward", label);
        if (!fp32 && gpu->set_precision(MOE_PREC_FP16, NULL, 0, 0) != MOE_OK) {
            fail_now("set_precision fp16");
            break;
        }
        /* fp32 mode: double exponentials as the reference, one rounding; fp16 mode: float
         * exponentials (a few ulp each) of x - lse rounded in float */
        const double rtol = fp32 ? 1e-6 : 2e-5;
        float *dloss = DEVF(fnan(N), N), *dlse = DEVF(fnan(N), N);
        gpu->cross_entropy_forward(dloss, dlse, dlog_, dtg, N, V);
        gpu_done();
        check_f("losses", HOSTF(dloss, N), loss, N, 1, fp32 ? 1e-6 : 1e-5, rtol);
        check_f("lse", HOSTF(dlse, N), lse, N, 1, fp32 ? 1e-6 : 1e-5, rtol);

        begin("cross_entropy_backward", label);
        float *dg = devf_at(fnan(NV), NV, goff);
        gpu->cross_entropy_backward(dg, dlog_, dlse_ref, dtg, scale, N, V);
        float *dip = devf_at(logits, NV, loff);
        gpu->cross_entropy_backward(dip, dip, dlse_ref, dtg, scale, N, V);
        gpu_done();
        const float *got = HOSTF(dg, NV);
        check_f("dlogits", got, g, NV, V, 1e-6 * scale, rtol); /* values are O(scale) */
        check_f("dlogits in place", HOSTF(dip, NV), got, NV, V, EXACT);

        /* both in one op: the bits of the two (forward, then backward from its lse) */
        begin("cross_entropy_fused", label);
        float *floss = DEVF(fnan(N), N), *flse = DEVF(fnan(N), N);
        float *fg = devf_at(fnan(NV), NV, goff), *ug = devf_at(fnan(NV), NV, goff);
        gpu->cross_entropy_fused(floss, flse, fg, dlog_, dtg, scale, N, V);
        gpu->cross_entropy_backward(ug, dlog_, dlse, dtg, scale, N, V); /* from dlse above */
        gpu_done();
        check_f("losses", HOSTF(floss, N), HOSTF(dloss, N), N, 1, EXACT);
        check_f("lse", HOSTF(flse, N), HOSTF(dlse, N), N, 1, EXACT);
        check_f("dlogits", HOSTF(fg, NV), HOSTF(ug, NV), NV, V, EXACT);
        check_f("dlogits against the reference", HOSTF(fg, NV), g, NV, V, 1e-6 * scale, rtol);
    }
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
    free_all();
}

/* ---- optimizer pieces
 * ---------------------------------------------------------------------------- */

static void test_reductions(size_t n, const char *name)
{
    float *x = frand(n, -1, 1), *dx = DEVF(x, n);
    double mag = 0.0;
    for (size_t i = 0; i < n; i++)
        mag += fabs(x[i]);

    begin("sum_values", name);
    double r = cpu->sum_values(x, n), g = gpu->sum_values(dx, n);
    gpu_done();
    check_d("sum", &g, &r, 1, 1e-13 * mag + 1e-300, 1e-12);

    begin("sum_squares", name);
    r = cpu->sum_squares(x, n);
    g = gpu->sum_squares(dx, n);
    gpu_done();
    check_d("sum", &g, &r, 1, 1e-300, 1e-12);

    begin("sum_into", name); /* onto what is there: a value, then the squares */
    double acc[2] = {1.25, 1.25};
    double *dacc = gpu->alloc(sizeof(double));
    gpu->copy(dacc, acc, sizeof(double), MOE_COPY_H2D);
    cpu->sum_into(acc, x, n, 0);
    cpu->sum_into(acc, x, n, 1);
    gpu->sum_into(dacc, dx, n, 0);
    gpu->sum_into(dacc, dx, n, 1);
    gpu->copy(acc + 1, dacc, sizeof(double), MOE_COPY_D2H);
    gpu_done();
    check_d("sum", &acc[1], &acc[0], 1, 1e-13 * mag + 1e-300, 1e-12);
    gpu->release(dacc);

    begin("scale_inplace", name);
    cpu->scale_inplace(x, 0.37f, n);
    gpu->scale_inplace(dx, 0.37f, n);
    gpu_done();
    check_f("x", HOSTF(dx, n), x, n, 1, EXACT);

    begin("all_finite", name);
    int want = cpu->all_finite(x, n), got = gpu->all_finite(dx, n);
    gpu_done();
    check_i("finite", &got, &want, 1);
    float bad[2] = {NAN, INFINITY};
    for (int b = 0; b < 2 && n > 0; b++) {
        size_t at = b == 0 ? n - 1 : n / 2;
        gpu->copy(dx + at, &bad[b], sizeof(float), MOE_COPY_H2D);
        x[at] = bad[b];
        want = cpu->all_finite(x, n);
        got = gpu->all_finite(dx, n);
        gpu_done();
        check_i(b == 0 ? "NaN at the end" : "inf in the middle", &got, &want, 1);
    }
    free_all();
}

static void test_adamw(size_t n, int t, const char *name)
{
    begin("adamw_update", name);
    float *p = frand(n, -1, 1), *g = frand(n, -1, 1), *m = frand(n, -0.1, 0.1);
    float *v = frand(n, 0, 0.01);
    float *dp = DEVF(p, n), *dm = DEVF(m, n), *dv = DEVF(v, n);
    cpu->adamw_update(p, g, m, v, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    gpu->adamw_update(dp, DEVF(g, n), dm, dv, n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, t);
    gpu_done();
    check_f("p", HOSTF(dp, n), p, n, 1, TIGHT);
    check_f("m", HOSTF(dm, n), m, n, 1, TIGHT);
    check_f("v", HOSTF(dv, n), v, n, 1, TIGHT);
    free_all();
}

/* Random parameters, gradients and moments of n elements; bf16 moments (moments16): the
 * same random values rounded, in the first half of m and v. */
static void adamw_inputs(size_t n, int moments16, float **p, float **g, float **m, float **v)
{
    *p = frand(n, -1, 1);
    *g = frand(n, -1, 1);
    *m = frand(n, -0.1, 0.1);
    *v = frand(n, 0, 0.01);
    uint16_t *m16 = (uint16_t *)*m, *v16 = (uint16_t *)*v;
    for (size_t i = 0; moments16 && i < n; i++) {
        m16[i] = moe_bf16_round((*m)[i]);
        v16[i] = moe_bf16_round((*v)[i]);
    }
}

/* Multi-tensor AdamW: segments with different weight decay, the gradients' factor from
 * the sums of squares sq (device memory on the GPU), the clip and the loss scale. sq
 * NULL: no norm (the factor is 1 / scale), and the sums of squares below and from the
 * split n / 2 + 1 come out of the update (sq_out), checked against the CPU's. */
static void test_adamw_multi(size_t n, int t, const double sq[2], double clip, double scale,
                             int moments16, const char *name)
{
    begin("adamw_update_multi", name);
    float *p, *g, *m, *v;
    adamw_inputs(n, moments16, &p, &g, &m, &v);
    const uint16_t *m16 = (const uint16_t *)m, *v16 = (const uint16_t *)v;
    int64_t off[4] = {0, (int64_t)(n / 3), (int64_t)(n / 3 + 1), (int64_t)n};
    float wd[3] = {0.1f, 0.0f, 0.05f};
    float *dp = DEVF(p, n), *dm = DEVF(m, n), *dv = DEVF(v, n);
    int64_t *doff = gpu->alloc(sizeof off);
    float *dwd = gpu->alloc(sizeof wd);
    gpu->copy(doff, off, sizeof off, MOE_COPY_H2D);
    gpu->copy(dwd, wd, sizeof wd, MOE_COPY_H2D);
    double *dsq = gpu->alloc(2 * sizeof(double)), *dsq_out = gpu->alloc(2 * sizeof(double));
    if (sq)
        gpu->copy(dsq, sq, 2 * sizeof(double), MOE_COPY_H2D);
    const float p_before = p[n / 2];
    double sq_out[2] = {-1, -1};
    const size_t split = n / 2 + 1;
    cpu->adamw_update_multi(p, g, m, v, moments16, n, 0, n, off, wd, 3, 1e-3f, 0.9f, 0.95f, 1e-8f,
                            sq, clip, scale, t, sq ? NULL : sq_out, split);
    gpu->adamw_update_multi(dp, DEVF(g, n), dm, dv, moments16, n, 0, n, doff, dwd, 3, 1e-3f, 0.9f,
                            0.95f, 1e-8f, sq ? dsq : NULL, clip, scale, t, sq ? NULL : dsq_out,
                            split);
    gpu_done();
    if (!sq) { /* the same squares in another order: a few roundings of double apart */
        const double *got = (const double *)host_of(dsq_out, 2 * sizeof(double));
        check_d("sums of squares", got, sq_out, 2, 0.0, 1e-12);
        if (!(sq_out[0] > 0 && sq_out[1] > 0))
            fail_now("the reference's sums of squares are not positive");
    }
    check_f("p", HOSTF(dp, n), p, n, 1, TIGHT);
    if (moments16) { /* the same double arithmetic rounded the same way: identical bits */
        if (memcmp(host_of(dm, 2 * n), m16, 2 * n) || memcmp(host_of(dv, 2 * n), v16, 2 * n))
            fail_now("bf16 moments differ from the reference");
    } else {
        check_f("m", HOSTF(dm, n), m, n, 1, TIGHT);
        check_f("v", HOSTF(dv, n), v, n, 1, TIGHT);
    }
    /* the reference moved p unless the factor says skip (then both left it alone) */
    const int skip = sq && moe_adamw_factor(sq, clip, scale) < 0;
    if ((p[n / 2] == p_before) != skip)
        fail_now(skip ? "the reference changed p on a skipped step" : "the reference left p");
    gpu->release(dsq);
    gpu->release(dsq_out);
    gpu->release(doff);
    gpu->release(dwd);
    free_all();
}

/* bf16 master weights (master_in_shadow): elements from `from` on are updated in the
 * bf16 shadow only, rounded stochastically. The reference: the CPU's AdamW on the same
 * values, those elements starting from their bf16 rounding (fp32 results r). Each new
 * bf16 weight must be one of the two bf16 neighbours of r (exactly r when r is bf16),
 * and on average the weights must move as far as r did: R = sum of sign(r - p) (new -
 * p) over sum of |r - p| within 0.1 of 1 (the cases have enough elements for the
 * rounding's noise to stay below 2% of it; with lr 1e-5 every step is below half an ulp
 * for |p| > 1/64, where rounding to nearest would give R near 0). The arena's fp32
 * copies of those elements stay as they were until sync_master. */
static void test_adamw_master16(size_t n, size_t from, int moments16, float lr, const char *name)
{
    begin("adamw_update_multi", name);
    float *p, *g, *m, *v;
    adamw_inputs(n, moments16, &p, &g, &m, &v);
    const uint16_t *m16 = (const uint16_t *)m, *v16 = (const uint16_t *)v;
    float *p_in = malloc(sizeof(float) * n);
    for (size_t i = 0; p_in && i < n; i++) /* the bf16 master weights are bf16 values */
        p_in[i] = i >= from ? moe_bf16_widen(moe_bf16_round(p[i])) : p[i];
    if (!p_in) {
        fail_now("out of host memory");
        return;
    }
    memcpy(p, p_in, sizeof(float) * n);
    int64_t off[3] = {0, (int64_t)(n / 4), (int64_t)n};
    float wd[2] = {0.1f, 0.02f};
    float *dp = DEVF(p, n), *dm = DEVF(m, n), *dv = DEVF(v, n);
    int64_t *doff = gpu->alloc(sizeof off);
    float *dwd = gpu->alloc(sizeof wd);
    gpu->copy(doff, off, sizeof off, MOE_COPY_H2D);
    gpu->copy(dwd, wd, sizeof wd, MOE_COPY_H2D);
    double sq[2] = {3.0, 5.0};
    double *dsq = gpu->alloc(sizeof sq);
    gpu->copy(dsq, sq, sizeof sq, MOE_COPY_H2D);
    if (gpu->set_precision(MOE_PREC_BF16, dp, n, 0) != MOE_OK ||
        gpu->master_in_shadow(from) != MOE_OK || gpu->refresh_shadow() != MOE_OK) {
        fail_now("set_precision bf16 with bf16 master weights");
        goto done;
    }
    cpu->adamw_update_multi(p, g, m, v, moments16, n, 0, n, off, wd, 2, lr, 0.9f, 0.95f, 1e-8f, sq,
                            0.5, 2.0, 3, NULL, n);
    gpu->adamw_update_multi(dp, DEVF(g, n), dm, dv, moments16, n, 0, n, doff, dwd, 2, lr, 0.9f,
                            0.95f, 1e-8f, dsq, 0.5, 2.0, 3, NULL, n);
    gpu_done();
    const float *before = HOSTF(dp, n); /* before sync_master: the arena's copies */
    if (gpu->sync_master() != MOE_OK) {
        fail_now("sync_master");
        goto done;
    }
    gpu_done();
    const float *got = HOSTF(dp, n);
    check_f("p below the bf16 master weights", got, p, from, 1, TIGHT);
    size_t far = 0, stale_bad = 0;
    double moved = 0.0, want = 0.0; /* sum of sign(r - p)(new - p), sum of |r - p| */
    for (size_t i = from; i < n; i++) {
        const float r = p[i], near = moe_bf16_widen(moe_bf16_round(r));
        /* the bf16 neighbours of r: its rounding and the next bf16 value on r's other side
         * (one step of the bf16 bit pattern away from zero when |near| < |r|, else toward) */
        const uint16_t b = moe_bf16_round(r);
        const uint16_t b2 = fabsf(near) < fabsf(r) ? (uint16_t)(b + 1) : (uint16_t)(b - 1);
        if (got[i] != near && !(near != r && got[i] == moe_bf16_widen(b2)))
            far++;
        const double d = (double)r - p_in[i];
        moved += (d > 0 ? 1 : d < 0 ? -1 : 0) * ((double)got[i] - p_in[i]);
        want += fabs(d);
        /* the arena held the inputs up to the sync; the reference moved them */
        stale_bad += before[i] != p_in[i];
    }
    const double R = want > 0 ? moved / want : 0.0;
    cur->checks++;
    if (far || !(fabs(R - 1.0) < 0.1) || stale_bad) {
        printf("FAIL adamw_update_multi [%s]: %zu of %zu bf16 weights not a neighbour of the "
               "reference, the weights moved %.4f of the reference's way, %zu fp32 copies "
               "changed before sync_master\n",
               name, far, n - from, R, stale_bad);
        cur->failed++;
    } else {
        printf("  adamw_update_multi [%s]: the bf16 weights moved %.4f of the reference's way\n",
               name, R);
    }
    if (moments16) { /* the same float arithmetic rounded the same way */
        if (memcmp(host_of(dm, 2 * n), m16, 2 * n) || memcmp(host_of(dv, 2 * n), v16, 2 * n))
            fail_now("bf16 moments differ from the reference");
    } else {
        check_f("m", HOSTF(dm, n), m, n, 1, TIGHT);
        check_f("v", HOSTF(dv, n), v, n, 1, TIGHT);
    }
done:
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
    free(p_in);
    gpu->release(dsq);
    gpu->release(doff);
    gpu->release(dwd);
    free_all();
}

/* The update in pieces on the background queue (backend.h background; the trainer's
 * update during the backward): pieces [cut[i], cut[i + 1]) with ends inside the vector
 * groups, a piece shorter than a group, an empty one and one across the start of the
 * bf16 master weights at `from` give every element the whole pass's bits (parameters,
 * moments, the stochastically rounded bf16 weights), and their sums of squares add up
 * to the whole pass's within 1e-12. */
static void test_adamw_pieces(size_t n, size_t from, int moments16, const char *name)
{
    begin("adamw_update_multi", name);
    float *p, *g, *m, *v;
    adamw_inputs(n, moments16, &p, &g, &m, &v);
    for (size_t i = from; i < n; i++) /* the bf16 master weights are bf16 values */
        p[i] = moe_bf16_widen(moe_bf16_round(p[i]));
    const size_t mb = (moments16 ? 2 : 4) * n, split = n / 2 + 3;
    int64_t off[4] = {0, (int64_t)(n / 3), (int64_t)(n / 3 + 1), (int64_t)n};
    float wd[3] = {0.1f, 0.0f, 0.05f};
    const size_t cut[] = {0, 3, 3, 13, 17, n / 3 + 5, from - 1, from + 7, split + 2, n};
    enum { pieces = sizeof cut / sizeof cut[0] - 1 };
    float *dp = DEVF(p, n), *dg = DEVF(g, n);
    void *dm = dev(m, mb), *dv = dev(v, mb);
    int64_t *doff = dev(off, sizeof off);
    float *dwd = DEVF(wd, 3);
    double *dsq = dmem(sizeof(double) * 2 * (pieces + 1));
    float *got[2];
    void *gm[2], *gv[2];
    for (int k = 0; k < 2; k++) { /* k 0: the whole pass; 1: the pieces */
        gpu->copy(dp, p, sizeof(float) * n, MOE_COPY_H2D);
        gpu->copy(dm, m, mb, MOE_COPY_H2D);
        gpu->copy(dv, v, mb, MOE_COPY_H2D);
        if (gpu->set_precision(MOE_PREC_BF16, dp, n, 0) != MOE_OK ||
            gpu->master_in_shadow(from) != MOE_OK || gpu->refresh_shadow() != MOE_OK) {
            fail_now("set_precision bf16 with bf16 master weights");
            goto done;
        }
        if (k == 0)
            gpu->adamw_update_multi(dp, dg, dm, dv, moments16, n, 0, n, doff, dwd, 3, 1e-3f, 0.9f,
                                    0.95f, 1e-8f, NULL, 0.0, 1.0, 7, dsq, split);
        for (int c = 0; k == 1 && c < pieces; c++) {
            gpu->background(1);
            gpu->adamw_update_multi(dp, dg, dm, dv, moments16, n, cut[c], cut[c + 1], doff, dwd, 3,
                                    1e-3f, 0.9f, 0.95f, 1e-8f, NULL, 0.0, 1.0, 7, dsq + 2 * (c + 1),
                                    split);
            gpu->background(0);
        }
        gpu->background_join();
        if (gpu->sync_master() != MOE_OK)
            fail_now("sync_master");
        gpu_done();
        got[k] = HOSTF(dp, n);
        gm[k] = host_of(dm, mb);
        gv[k] = host_of(dv, mb);
    }
    const double *sq = host_of(dsq, sizeof(double) * 2 * (pieces + 1));
    double sum[2] = {0, 0};
    for (int c = 0; c < pieces; c++)
        for (int s = 0; s < 2; s++)
            sum[s] += sq[2 * (c + 1) + s];
    check_d("the pieces' sums of squares", sum, sq, 2, 0.0, 1e-12);
    cur->checks++;
    if (memcmp(got[0], got[1], sizeof(float) * n) || memcmp(gm[0], gm[1], mb) ||
        memcmp(gv[0], gv[1], mb)) {
        printf("FAIL adamw_update_multi [%s]: the pieces' bits differ from the whole pass's\n",
               name);
        cur->failed++;
    }
    size_t moved = 0;
    for (size_t i = 0; i < n; i++)
        moved += got[1][i] != p[i];
    if (moved < n / 2) /* lr 1e-3: nearly every weight moves */
        fail_now("the pieces left most weights where they were");
done:
    if (gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0) != MOE_OK)
        fail_now("set_precision fp32");
    free_all();
}

/* ---- main
 * ---------------------------------------------------------------------------------------- */

int main(void)
{
    const char *why = NULL;
    gpu = moe_backend_cuda(&why);
    if (!gpu) {
        printf("SKIP: no usable GPU: %s\n", why ? why : "unknown");
        return 77;
    }

    test_add(1, "n=1");
    test_add(91, "n=91");
    test_add(512 * 64 + 3, "n=32771");

    test_embedding(7, 13, 11, "N=7 D=13 V=11");
    test_embedding(1, 5, 3, "one token");
    test_embedding(512, 64, 256, "tiny");
    test_embedding(3000, 33, 5, "many repeats");
    test_embedding(3000, 36, 5, "many repeats, float4");
    /* the sort's radix passes by V: 2 up to 2^16 (V = 256, 65536), 4 above (65537) */
    test_embedding(3000, 8, 256, "V=256");
    test_embedding(5000, 8, 65536, "V=65536");
    test_embedding(5000, 8, 65537, "V=65537");
    /* the sort's passes in one block (the default up to 65536 items), and in several
     * (past that, or MOE_SORT_ONE_BLOCK=0) */
    test_embedding(70000, 4, 1000, "N=70000 (the multi-block sort)");
    setenv("MOE_SORT_ONE_BLOCK", "0", 1);
    test_embedding(5000, 8, 65537, "V=65537, MOE_SORT_ONE_BLOCK=0");
    test_embedding(3000, 33, 5, "many repeats, MOE_SORT_ONE_BLOCK=0");
    unsetenv("MOE_SORT_ONE_BLOCK");

    test_rmsnorm(7, 13, "N=7 D=13");
    test_rmsnorm(1, 64, "one token");
    test_rmsnorm(512, 64, "tiny");
    test_rmsnorm(600, 1000, "N=600 D=1000");
    test_rmsnorm(2051, 1024, "D=1024, 129 row blocks (the model's width)");
    test_rmsnorm(37, 2048, "D=2048 (one pass, 2 groups a thread)");
    test_rmsnorm(33, 4096, "D=4096 (one pass, 4 groups a thread)");
    test_rmsnorm(17, 4100, "D=4100 (two passes)");
    /* the one-pass backward in blocks of 1 and 7 rows (MOE_RMSNORM_ROWS; 32 by default:
     * 2051 and 33 rows end in a short block either way) */
    setenv("MOE_RMSNORM_ROWS", "1", 1);
    test_rmsnorm(600, 1024, "D=1024, 1 row a block");
    setenv("MOE_RMSNORM_ROWS", "7", 1);
    test_rmsnorm(2051, 1024, "D=1024, 7 rows a block");
    test_rmsnorm(33, 4096, "D=4096, 7 rows a block");
    unsetenv("MOE_RMSNORM_ROWS");

    test_matmul(7, 13, 5, "N=7 I=13 O=5");
    test_matmul(1, 1, 1, "1x1x1");
    test_matmul(1, 64, 256, "one token");
    test_matmul(512, 64, 64, "tiny attn proj");
    test_matmul(512, 64, 128, "tiny up");
    test_matmul(512, 128, 64, "tiny down");
    test_matmul(512, 64, 256, "tiny lm head");
    test_matmul(512, 64, 8, "tiny router");
    test_matmul(33, 77, 1, "O=1");
    test_matmul_shapes(900, "900 shapes (plan cache flush)");
    /* the attention projection's shape at the bench (16384 rows there) and an odd one */
    test_gemm_tune(4096, 1024, 1024, MOE_PREC_FP32, "fp32 4096x1024x1024");
    test_gemm_tune(4096, 1024, 1024, MOE_PREC_FP16, "fp16 4096x1024x1024");
    test_gemm_tune(1000, 96, 200, MOE_PREC_FP16, "fp16 1000x96x200");
    if (gpu->set_precision(MOE_PREC_BF16, NULL, 0, 0) == MOE_OK) /* sm_80 and later */
        test_gemm_tune(4096, 1024, 1024, MOE_PREC_BF16, "bf16 4096x1024x1024");

    const int g1[] = {3, 0, 5, 1};
    test_grouped(4, g1, 13, 7, "odd, an empty group");
    const int g2[] = {70, 0, 130, 1, 64, 200, 0, 47};
    test_grouped(8, g2, 64, 128, "tiny w1");
    test_grouped(8, g2, 128, 64, "tiny w2");
    const int g3[] = {0, 0};
    test_grouped(2, g3, 16, 16, "all groups empty");
    int g4[300]; /* more groups than one grouped call takes (256) */
    for (int g = 0; g < 300; g++)
        g4[g] = (g * 37) % 11 == 3 ? 0 : 1 + (g * 13) % 9;
    test_grouped(300, g4, 24, 40, "300 groups");
    long grouped_calls = 0, single_gemms = 0;
    moe_cuda_grouped_counts(&grouped_calls, &single_gemms);
    printf("grouped GEMMs (fp32): %ld grouped calls, %ld GEMMs one by one\n", grouped_calls,
           single_gemms);
    begin("grouped_matmul_forward", "one grouped call per op (not one GEMM per group)");
    {
        int got = grouped_calls > 0 && single_gemms == 0, want = 1;
        check_i("grouped form used", &got, &want, 1);
    }

    test_swiglu(1, "n=1");
    test_swiglu(1001, "n=1001");
    test_swiglu(512 * 128, "tiny");

    test_rope(2, 5, 3, 6, 10000.0, "B=2 T=5 H=3 Hd=6");
    test_rope(8, 64, 4, 16, 10000.0, "tiny");
    test_rope(1, 256, 2, 64, 500000.0, "T=256 Hd=64");
    test_rope(1, 1, 1, 2, 10000.0, "T=1 Hd=2");

    test_attention(1, 1, 1, 2, 1.0, "T=1 Hd=2");
    test_attention(2, 1, 3, 16, 1.0, "T=1 B=2 H=3");
    test_attention(2, 7, 3, 6, 1.0, "B=2 T=7 H=3 Hd=6");
    test_attention(8, 64, 4, 16, 1.0, "tiny");
    test_attention(1, 256, 2, 64, 1.0, "T=256 Hd=64");
    test_attention(2, 100, 2, 32, 3.0, "T=100 Hd=32 peaky");
    test_attention(1, 33, 1, 128, 1.0, "T=33 Hd=128");
    test_attention(1, 40, 2, 96, 1.0, "T=40 Hd=96");

    test_router(7, 5, 1, 0, 0, "N=7 E=5 K=1");
    test_router(7, 5, 5, 1, 0, "K=E renorm");
    test_router(7, 5, 5, 0, 1, "K=E ties");
    test_router(1, 3, 2, 1, 0, "one token");
    test_router(512, 8, 2, 1, 0, "tiny");
    test_router(512, 8, 2, 0, 1, "tiny ties");
    test_router(33, 64, 6, 1, 1, "E=64 K=6 ties");
    test_router(5, 300, 3, 1, 0, "E=300");
    test_router(2100, 32, 2, 1, 0, "N=2100 E=32 (33 chunks, the last partial)");
    test_router(700, 600, 2, 1, 1, "E=600 (fewer warps per block) ties");

    test_route(7, 5, 2, 7, -1, IDX_RANDOM, 13, "dropless N=7 E=5 K=2");
    test_route(12, 8, 2, 12, -1, IDX_HOLES, 9, "zero-token expert, no-expert slots");
    test_route(9, 4, 1, 9, -1, IDX_RANDOM, 5, "K=1");
    test_route(6, 4, 4, 6, -1, IDX_RANDOM, 5, "K=E");
    test_route(1, 4, 2, 1, -1, IDX_RANDOM, 8, "one token");
    test_route(0, 4, 2, 1, -1, IDX_RANDOM, 8, "no tokens");
    test_route(16, 4, 2, 16, 3, IDX_SKEWED, 7, "capacity 3, ties");
    test_route(12, 4, 2, 4, 2, IDX_SKEWED, 7, "capacity 2 per group of 4");
    test_route(12, 8, 2, 12, 2, IDX_HOLES, 7, "capacity with holes");
    test_route(10, 4, 2, 10, 0, IDX_RANDOM, 3, "capacity 0");
    test_route(512, 8, 2, 512, -1, IDX_RANDOM, 64, "tiny dropless");
    test_route(512, 8, 2, 512, 128, IDX_SKEWED, 64, "tiny capacity 128");
    test_route(4096, 64, 4, 4096, 300, IDX_SKEWED, 32, "N=4096 E=64 K=4 capacity");
    test_route(4096, 64, 4, 1, 1, IDX_RANDOM, 4, "capacity 1 per token (many groups)");
    test_route(300, 8, 2, 300, -1, IDX_HOLES, 1000, "D=1000 (rows of several steps)");
    /* the gradient rows' other forms (the cases above with D % 4 == 0 and K even take
     * the 4-value one): pairs (D % 4 == 2), and single values (D + K odd) */
    test_route(300, 8, 2, 300, -1, IDX_RANDOM, 66, "D=66 (pairs)");
    test_route(64, 8, 3, 64, -1, IDX_HOLES, 12, "D=12 K=3 (single values)");
    /* the sort by expert in one block (the default up to 65536 items and 256 experts) at
     * the bench shape's size, past those limits (several blocks), and in several blocks
     * at every size (MOE_SORT_ONE_BLOCK=0) */
    test_route(16384, 32, 2, 16384, -1, IDX_RANDOM, 4, "N=16384 E=32 K=2 (the bench shape)");
    test_route(40000, 32, 2, 40000, -1, IDX_RANDOM, 4, "N=40000 K=2 (80000 items, several blocks)");
    test_route(2000, 300, 2, 2000, -1, IDX_RANDOM, 4, "E=300 (several blocks)");
    setenv("MOE_SORT_ONE_BLOCK", "0", 1);
    test_route(512, 8, 2, 512, -1, IDX_RANDOM, 64, "tiny dropless, MOE_SORT_ONE_BLOCK=0");
    test_route(4096, 64, 4, 4096, 300, IDX_SKEWED, 32, "E=64 K=4 capacity, MOE_SORT_ONE_BLOCK=0");
    test_route(16384, 32, 2, 16384, -1, IDX_RANDOM, 4, "the bench shape, MOE_SORT_ONE_BLOCK=0");
    unsetenv("MOE_SORT_ONE_BLOCK");
    test_permute_backward_any(37, 200, 11, "any order, repeats");
    test_permute_backward_any(5000, 300, 3, "sparse targets");

    test_routing_stats(1, 4, 2, 0, "one token");
    test_routing_stats(777, 8, 2, 1, "N=777 E=8 K=2 with transitions");
    test_routing_stats(5000, 32, 4, 1, "N=5000 E=32 K=4 with transitions");
    test_routing_stats(300, 6, 6, 0, "K=E");

    test_exchange(7, 6, 2, 1, 13, -1, "P=1");
    test_exchange(13, 6, 2, 3, 9, -1, "P=3 dropless");
    test_exchange(13, 6, 3, 3, 9, 4, "P=3 capacity");
    /* D = 64: 8 token values a thread (rows of 272, 144 bytes), 4 where the rows are only
     * 8-byte aligned (K = 3: 280, 152 bytes) or with MOE_EXCHANGE_ROWS_V8=0 */
    test_exchange(512, 8, 2, 4, 64, 160, "tiny P=4");
    test_exchange(300, 8, 3, 2, 64, -1, "D=64 K=3 (rows 8-byte aligned)");
    /* the fill's lanes take four groups at once while 4 * 32 groups remain, then one:
     * D = 1000 is 125 groups of 8 (lanes 0..28 take both forms) */
    test_exchange(300, 8, 2, 2, 1000, -1, "D=1000 (the fill's lanes four groups at once)");
    /* the unpack by whole rows a warp from 32 groups of token values a row (D = 256: 32
     * groups of 8, D = 1000: 125), one thread a group below that (D = 248: 31) or with
     * MOE_UNPACK_ROWS=0 */
    test_exchange(200, 8, 2, 2, 256, -1, "D=256 (the unpack's warp rows, 32 groups)");
    test_exchange(200, 8, 2, 2, 248, -1, "D=248 (the unpack's thread groups, 31)");
    setenv("MOE_UNPACK_ROWS", "0", 1);
    test_exchange(300, 8, 2, 2, 1000, -1, "D=1000, MOE_UNPACK_ROWS=0");
    unsetenv("MOE_UNPACK_ROWS");
    setenv("MOE_EXCHANGE_ROWS_V8", "0", 1);
    test_exchange(512, 8, 2, 4, 64, 160, "tiny P=4, MOE_EXCHANGE_ROWS_V8=0");
    unsetenv("MOE_EXCHANGE_ROWS_V8");
    test_exchange(1, 4, 2, 2, 5, -1, "one token");
    test_exchange(9, 4, 2, 2, 5, 0, "everything dropped");
    /* the counts in shared memory (the default where P + E <= 4096), in global memory
     * past that or with MOE_DISPATCH_FLAGS_SHARED=0 */
    test_exchange(16384, 32, 2, 1, 4, -1, "N=16384 E=32 P=1 (the bench shape's counts)");
    test_exchange(300, 4200, 2, 2, 4, -1, "E=4200 (counts past shared memory)");
    /* up to 2048 tiles of 32 pairs each fill block sums the earlier tiles' rows; past
     * that, or with MOE_DISPATCH_FILL_SUMS=0, a scan does (three passes past 1024 tiles) */
    test_exchange(20000, 32, 2, 2, 8, -1, "P=2 N=20000 (1250 tiles)");
    test_exchange(32768, 32, 2, 2, 8, -1, "P=2 N=32768 (2048 tiles: the fill's sums)");
    test_exchange(32784, 32, 2, 2, 8, -1, "P=2 N=32784 (2049 tiles: the scan)");
    setenv("MOE_DISPATCH_FILL_SUMS", "0", 1);
    test_exchange(512, 8, 2, 4, 64, 160, "tiny P=4, MOE_DISPATCH_FILL_SUMS=0 (one pass)");
    test_exchange(20000, 32, 2, 2, 8, -1, "P=2 N=20000, MOE_DISPATCH_FILL_SUMS=0 (three)");
    unsetenv("MOE_DISPATCH_FILL_SUMS");
    /* the counts stored by the fill's first block into the pinned host memory where the
     * cells are at most 1024 and the blocks' cells at most 65536; else (or with
     * MOE_DISPATCH_COUNTS_DIRECT=0) added into device memory and copied */
    test_exchange(300, 1200, 2, 1, 4, -1, "E=1200 P=1 (1202 cells: the counts copied)");
    test_exchange(20000, 512, 2, 2, 4, -1, "E=512 P=2 (157 blocks of 516 cells: copied)");
    test_exchange(20000, 384, 2, 2, 4, -1, "E=384 P=2 (157 blocks of 388 cells: direct)");
    setenv("MOE_DISPATCH_COUNTS_DIRECT", "0", 1);
    test_exchange(512, 8, 2, 4, 64, 160, "tiny P=4, MOE_DISPATCH_COUNTS_DIRECT=0");
    test_exchange(16384, 32, 2, 1, 4, -1, "the bench shape, MOE_DISPATCH_COUNTS_DIRECT=0");
    unsetenv("MOE_DISPATCH_COUNTS_DIRECT");
    setenv("MOE_DISPATCH_FLAGS_SHARED", "0", 1);
    test_exchange(512, 8, 2, 4, 64, 160, "tiny P=4, MOE_DISPATCH_FLAGS_SHARED=0");
    test_exchange(16384, 32, 2, 1, 4, -1, "the bench shape, MOE_DISPATCH_FLAGS_SHARED=0");
    unsetenv("MOE_DISPATCH_FLAGS_SHARED");

    test_cross_entropy(7, 13, 0, 0, 0, "N=7 V=13");
    test_cross_entropy(1, 5, 0, 0, 0, "one token");
    test_cross_entropy(512, 256, 0, 0, 0, "tiny (float4)");
    test_cross_entropy(3, 50257, 0, 0, 0, "V=50257");
    test_cross_entropy(5, 32768, 0, 0, 0, "V=32768 (float4, 32 blocks a row)");
    test_cross_entropy(9, 4, 0, 0, 0, "V=4 (one float4 a row)");
    test_cross_entropy(33, 256, 1, 1, 0, "V=256 unaligned (float path)");
    test_cross_entropy(33, 256, 0, 1, 0, "V=256, dlogits unaligned");
    test_cross_entropy(6, 1000, 0, 0, 1, "-inf logits (float4)");
    test_cross_entropy(6, 999, 0, 0, 1, "-inf logits");

    test_reductions(1, "n=1");
    test_reductions(1000, "n=1000");
    test_reductions(1000003, "n=1000003");
    begin("all_finite", "n=0");
    {
        int got = gpu->all_finite(NULL, 0), want = 1;
        check_i("empty", &got, &want, 1);
    }

    const double sq[2] = {0.3, 0.2}, inf_sq[2] = {0.3, INFINITY};
    test_adamw_multi(1000, 3, sq, 0.0, 1.7, 0, "3 segments, loss scale 1.7");
    test_adamw_multi(7, 1, sq, 0.2, 1.0, 0, "tiny, clipped");
    test_adamw_multi(100003, 2, sq, 0.1, 3.0, 0, "4-element groups, a 3-element tail, clipped");
    test_adamw_multi(1000, 3, inf_sq, 1.0, 1.0, 0, "non-finite norm: skipped");
    test_adamw_multi(100003, 2, sq, 0.1, 3.0, 1, "bf16 moments, a 3-element tail, clipped");
    test_adamw_multi(7, 4, sq, 0.0, 1.0, 1, "bf16 moments, tiny");
    test_adamw_multi(3000001, 2, NULL, 0.0, 1.0, 1, "no norm, sums of squares out, bf16 moments");
    test_adamw_multi(1001, 3, NULL, 0.0, 2.0, 0, "no norm, sums of squares out, loss scale 2");
    test_adamw_master16(100000, 40000, 1, 1e-3f, "bf16 master weights from 40000, bf16 moments");
    test_adamw_master16(100003, 40001, 0, 1e-3f,
                        "bf16 master weights from 40001 (unaligned), fp32 moments");
    test_adamw_master16(1000000, 0, 1, 1e-5f, "bf16 master weights throughout, steps below an ulp");
    test_adamw_master16(100007, 40004, 1, 1e-3f, "bf16 master weights from 40004 (steps of 4)");
    test_adamw_pieces(1000003, 400000, 1, "pieces on the background queue, bf16 moments");
    test_adamw_pieces(100007, 40004, 0, "pieces on the background queue, fp32 moments, steps of 4");
    test_adamw(1, 1, "n=1 t=1");
    test_adamw(1001, 7, "n=1001 t=7");

    int failed = 0;
    printf("\n%-26s %12s %12s  %s\n", "op", "worst_abs", "worst_rel", "result");
    for (int i = 0; i < n_results; i++) {
        const op_result *r = &results[i];
        printf("%-26s %12.3g %12.3g  %s\n", r->op, r->worst_abs, r->worst_rel,
               r->failed ? "FAIL" : "PASS");
        failed += r->failed != 0;
    }
    /* every op of the table must have been tested */
    const char *listed[] = {
#define MOE_OP_NAME(fn) #fn,
        MOE_OPS_LIST(MOE_OP_NAME)
#undef MOE_OP_NAME
    };
    for (size_t i = 0; i < sizeof listed / sizeof *listed; i++) {
        int seen = 0;
        for (int j = 0; j < n_results; j++)
            seen |= strcmp(results[j].op, listed[i]) == 0;
        if (!seen) {
            printf("FAIL %s: no test\n", listed[i]);
            failed++;
        }
    }
    printf("%s: %d of %d ops failed\n", failed ? "FAIL" : "PASS", failed, n_results);
    return failed ? 1 : 0;
}
