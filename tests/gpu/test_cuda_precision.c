/* tests/gpu/test_cuda_precision.c: the GEMMs of the "cuda" backend in bf16 and fp16
 * (16-bit operands from the parameter shadow and the rounding workspaces, fp32
 * accumulation and outputs) and its tensor-core attention (forward and backward; tail
 * tile, T = 1, Hd = 32, 64, 128, a NULL gradient) against the fp32 CPU reference, on
 * random data (never zeros).
 * Bound: relative error of each output, as ||gpu - ref|| / ||ref|| over the tensor,
 * <= 1e-2 in bf16 and <= 5e-3 in fp16 (8 and 11 significand bits; the products sum in
 * fp32). The fp32 mode is checked too (<= 1e-5). Also: bf16 is refused below sm_80, a
 * weight outside the registered arena is reported, and every writer of a buffer marked as
 * holding its GEMM operand (SwiGLU, the cross-entropy backward, RMSNorm, the permutation)
 * stores the bits the rounding would give, and the GEMMs reading it give the same bits;
 * the grouped backward's write flags write dx and dw without reading them; the experts'
 * gate and up projections as one pair op (strided batches where the GEMMs run one by
 * one); GEMM outputs marked as 16-bit and SwiGLU reading them; 16-bit logits into the
 * cross-entropy; 16-bit q, k, v into rope and the attention; bf16 weight gradients of
 * bf16 master weights (grads_in_shadow) and their readers.
 * Without a GPU: SKIP, exit 77. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/backend.h"
#include "util/rng.h"

static const moe_backend *gpu;
static int failures;

static void fill(float *x, size_t n, uint64_t stream, double scale)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)(scale * moe_rng_normal(7, stream, i));
}

static double rel_err(const float *a, const float *b, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / (den > 0 ? den : 1));
}

static void report(const char *what, const char *mode, double err, double bound)
{
    int ok = err <= bound && isfinite(err);
    printf("%-32s %-5s rel err %.2e (bound %.0e) %s\n", what, mode, err, bound,
           ok ? "PASS" : "FAIL");
    failures += !ok;
}

static float *dev_copy(const float *h, size_t n)
{
    float *d = gpu->alloc(sizeof(float) * n);
    gpu->copy(d, h, sizeof(float) * n, MOE_COPY_H2D);
    return d;
}

static void to_host(float *h, const float *d, size_t n)
{
    gpu->copy(h, d, sizeof(float) * n, MOE_COPY_D2H);
}

/* Linear (N, I) -> (N, O) and a grouped linear over G experts, forward and backward. */
/* Whether the first nbytes of two device buffers differ (0: identical). */
static int differ_bytes(const void *a, const void *b, size_t nbytes)
{
    char *ha = malloc(nbytes), *hb = malloc(nbytes);
    gpu->copy(ha, a, nbytes, MOE_COPY_D2H);
    gpu->copy(hb, b, nbytes, MOE_COPY_D2H);
    const int d = memcmp(ha, hb, nbytes) != 0;
    free(ha);
    free(hb);
    return d;
}

/* Whether n floats of two device buffers differ. */
static int differ(const float *a, const float *b, size_t n)
{
    return differ_bytes(a, b, sizeof(float) * n);
}

/* SwiGLU into buffers marked as holding their GEMM operand (mark_operand) against
 * unmarked ones: in a 16-bit precision the marked h, da, db hold 16 bits (their bytes
 * differ from the fp32 ones), and the grouped GEMMs that read them give the same bits as
 * from the fp32 buffers they would round; in fp32 a mark changes nothing. x (N, I) and a
 * second input are the SwiGLU inputs, so h, da, db are (N, I). */
static void check_in_place(moe_precision p, const char *mode, const float *x, const float *dw_,
                           const int *offsets, int N, int I, int O, int G)
{
    const size_t n = (size_t)N * I, nw = (size_t)G * O * I;
    float *b = malloc(sizeof(float) * n);
    fill(b, n, 7, 1.0);
    float *da_in = dev_copy(x, n), *db_in = dev_copy(b, n);
    float *h[2], *ga[2], *gb[2], *out[2], *gx[2], *gw[2];
    for (int k = 0; k < 2; k++) { /* 0: plain fp32 buffers, 1: marked */
        h[k] = gpu->alloc(sizeof(float) * n);
        ga[k] = gpu->alloc(sizeof(float) * n);
        gb[k] = gpu->alloc(sizeof(float) * n);
        out[k] = gpu->alloc(sizeof(float) * (size_t)N * O);
        gx[k] = gpu->alloc(sizeof(float) * n);
        gw[k] = gpu->alloc(sizeof(float) * nw);
    }
    int st = gpu->mark_operand(h[1], n) != MOE_OK || gpu->mark_operand(ga[1], n) != MOE_OK ||
             gpu->mark_operand(gb[1], n) != MOE_OK;
    float *dh = dev_copy(b, n); /* an incoming gradient of h */
    for (int k = 0; k < 2; k++) {
        gpu->swiglu_forward(h[k], da_in, db_in, n);
        gpu->grouped_matmul_forward(out[k], h[k], dw_, offsets, G, I, O);
        gpu->swiglu_backward(ga[k], gb[k], dh, da_in, db_in, n);
        /* a backward whose output gradient is da (db), whose input is h: (N, I) both, so
         * the weights are (G, I, I), the start of the (G, O, I) arena */
        gpu->grouped_matmul_backward(gx[k], gw[k], ga[k], h[k], dw_, offsets, G, I, I,
                                     MOE_WRITE_DW | MOE_WRITE_DX);
        gpu->grouped_matmul_backward(gx[k], gw[k], gb[k], h[k], dw_, offsets, G, I, I, 0);
    }
    char what[96];
    const int want_differ = p != MOE_PREC_FP32;
    snprintf(what, sizeof what, "in place: h, da, db %s", want_differ ? "16-bit" : "unchanged");
    report(what, mode,
           (differ(h[0], h[1], n) != want_differ) + (differ(ga[0], ga[1], n) != want_differ) +
               (differ(gb[0], gb[1], n) != want_differ) + st,
           0.0);
    report("in place: GEMM outputs identical", mode,
           differ(out[0], out[1], (size_t)N * O) + differ(gx[0], gx[1], n) +
               differ(gw[0], gw[1], nw),
           0.0);
    for (int k = 0; k < 2; k++) {
        if (k == 1) {
            gpu->mark_operand(h[1], 0);
            gpu->mark_operand(ga[1], 0);
            gpu->mark_operand(gb[1], 0);
        }
        gpu->release(h[k]);
        gpu->release(ga[k]);
        gpu->release(gb[k]);
        gpu->release(out[k]);
        gpu->release(gx[k]);
        gpu->release(gw[k]);
    }
    gpu->release(da_in);
    gpu->release(db_in);
    gpu->release(dh);
    free(b);
}

/* Whether the 16-bit values in the first 2n bytes of the marked buffer m16 are the bf16
 * rounding of the fp32 buffer f32's (p bf16; other precisions: 0, nothing to compare). */
static int bf16_mismatches(moe_precision p, const float *f32, const float *m16, size_t n)
{
    if (p != MOE_PREC_BF16)
        return 0;
    float *f = malloc(sizeof(float) * n);
    uint16_t *b16 = malloc(sizeof(uint16_t) * n);
    to_host(f, f32, n);
    gpu->copy(b16, m16, sizeof(uint16_t) * n, MOE_COPY_D2H);
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += b16[i] != moe_bf16_round(f[i]);
    free(f);
    free(b16);
    return bad;
}

/* Whether the 16-bit values of the marked buffer m16 are the rounding of the fp32
 * buffer f32's, for a 16-bit precision p: the count of those that are not. */
static int round16_mismatches(moe_precision p, const float *f32, const void *m16, size_t n)
{
    float *f = malloc(sizeof(float) * n);
    uint16_t *b16 = malloc(sizeof(uint16_t) * n);
    to_host(f, f32, n);
    gpu->copy(b16, m16, sizeof(uint16_t) * n, MOE_COPY_D2H);
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += b16[i] != (p == MOE_PREC_BF16 ? moe_bf16_round(f[i]) : moe_fp16_round(f[i]));
    free(f);
    free(b16);
    return bad;
}

/* The cross-entropy backward into a buffer marked as holding its GEMM operand, against an
 * unmarked one, for N rows of V logits (V % 4 == 0: the float4 kernel; otherwise the
 * scalar one): in a 16-bit precision the marked one holds the 16-bit values (in bf16, bit
 * for bit moe_bf16_round of the fp32 ones) and the LM head's backward GEMMs that read it
 * give the same bits; in fp32 nothing changes. A marked buffer written in place (the
 * gradient over its logits) gets the fp32 values: 16-bit writes would overtake the reads.
 * w (V, I) lies in the parameter arena; h is (N, I). */
static void check_ce_in_place(moe_precision p, const char *mode, const float *w, int N, int V,
                              int I)
{
    const size_t n = (size_t)N * V;
    float *logits = malloc(sizeof(float) * n), *hh = malloc(sizeof(float) * (size_t)N * I);
    int32_t *tg = malloc(sizeof(int32_t) * N);
    fill(logits, n, 20, 3.0);
    fill(hh, (size_t)N * I, 21, 1.0);
    for (int r = 0; r < N; r++)
        tg[r] = (int32_t)(moe_rng_u64(7, 22, (uint64_t)r) % (uint64_t)V);
    float *dlog = dev_copy(logits, n), *h = dev_copy(hh, (size_t)N * I);
    float *lse = gpu->alloc(sizeof(float) * N), *loss = gpu->alloc(sizeof(float) * N);
    int32_t *dtg = gpu->alloc(sizeof(int32_t) * N);
    gpu->copy(dtg, tg, sizeof(int32_t) * N, MOE_COPY_H2D);
    gpu->cross_entropy_forward(loss, lse, dlog, dtg, N, V);
    float *dl[3], *gx[2], *gw[2];
    for (int k = 0; k < 3; k++) /* 0: plain, 1: marked, 2: marked and in place */
        dl[k] = k == 2 ? dev_copy(logits, n) : gpu->alloc(sizeof(float) * n);
    int st = gpu->mark_operand(dl[1], n) != MOE_OK || gpu->mark_operand(dl[2], n) != MOE_OK;
    for (int k = 0; k < 3; k++)
        gpu->cross_entropy_backward(dl[k], k == 2 ? dl[2] : dlog, lse, dtg, 0.01f, N, V);
    for (int k = 0; k < 2; k++) {
        gx[k] = gpu->alloc(sizeof(float) * (size_t)N * I);
        gw[k] = gpu->alloc(sizeof(float) * (size_t)V * I);
        gpu->zero(gx[k], sizeof(float) * (size_t)N * I);
        gpu->zero(gw[k], sizeof(float) * (size_t)V * I);
        gpu->matmul_backward(gx[k], gw[k], dl[k], h, w, N, I, V, 0);
    }
    const int want_differ = p != MOE_PREC_FP32;
    char what[96];
    snprintf(what, sizeof what, "ce bwd V=%d: dlogits %s", V, want_differ ? "16-bit" : "same");
    const int bad = st + (differ(dl[0], dl[1], n) != want_differ) + differ(dl[0], dl[2], n) +
                    bf16_mismatches(p, dl[0], dl[1], n);
    report(what, mode, bad, 0.0);
    /* forward and backward in one op into a marked buffer: the marked buffer's bits */
    float *fdl = gpu->alloc(sizeof(float) * n), *flse = gpu->alloc(sizeof(float) * N);
    float *floss = gpu->alloc(sizeof(float) * N);
    st = gpu->mark_operand(fdl, n) != MOE_OK;
    gpu->cross_entropy_fused(floss, flse, fdl, dlog, dtg, 0.01f, N, V);
    snprintf(what, sizeof what, "ce fused V=%d: marked dlogits, lse, losses same", V);
    report(what, mode,
           st + differ_bytes(fdl, dl[1], (want_differ ? 2 : 4) * n) + differ(flse, lse, N) +
               differ(floss, loss, N) + bf16_mismatches(p, dl[0], fdl, n),
           0.0);
    gpu->mark_operand(fdl, 0);
    gpu->release(fdl);
    gpu->release(flse);
    gpu->release(floss);
    snprintf(what, sizeof what, "ce bwd V=%d: GEMMs identical", V);
    report(what, mode, differ(gx[0], gx[1], (size_t)N * I) + differ(gw[0], gw[1], (size_t)V * I),
           0.0);
    gpu->mark_operand(dl[1], 0);
    gpu->mark_operand(dl[2], 0);
    for (int k = 0; k < 3; k++)
        gpu->release(dl[k]);
    for (int k = 0; k < 2; k++) {
        gpu->release(gx[k]);
        gpu->release(gw[k]);
    }
    gpu->release(dlog);
    gpu->release(h);
    gpu->release(lse);
    gpu->release(loss);
    gpu->release(dtg);
    free(logits);
    free(hh);
    free(tg);
}

static void read_marked(moe_precision p, float *h, const void *d, size_t n);

/* The LM head's logits marked as 16-bit: the GEMM writes them so (against the CPU's
 * product, the mode's bound) and the cross-entropy (forward, backward, fused) reads them:
 * losses, lse and dlogits against the CPU's on the same (widened) logits within 1e-5.
 * V % 4 == 0 takes the float4 kernels, else the scalar ones. w: (V, I) at the arena's
 * start. */
static void check_ce_logits16(moe_precision p, const char *mode, double bound, const float *w,
                              int N, int V, int I)
{
    const size_t n = (size_t)N * V;
    float *hh = malloc(sizeof(float) * (size_t)N * I), *L = malloc(sizeof(float) * n),
          *ref = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    float rl[2][N], gl[2][N]; /* losses, lse: reference and got */
    int32_t *tg = malloc(sizeof(int32_t) * N);
    fill(hh, (size_t)N * I, 31, 1.0);
    for (int r = 0; r < N; r++)
        tg[r] = (int32_t)(moe_rng_u64(7, 32, (uint64_t)r) % (uint64_t)V);
    float *h = dev_copy(hh, (size_t)N * I), *lg = gpu->alloc(sizeof(float) * n),
          *dl = gpu->alloc(sizeof(float) * n), *loss = gpu->alloc(sizeof(float) * N),
          *lse = gpu->alloc(sizeof(float) * N);
    int32_t *dtg = gpu->alloc(sizeof(int32_t) * N);
    gpu->copy(dtg, tg, sizeof(int32_t) * N, MOE_COPY_H2D);
    const int st = gpu->mark_operand(lg, n) != MOE_OK;
    gpu->matmul_forward(lg, h, w, N, I, V);
    read_marked(p, L, lg, n);
    float *hw = malloc(sizeof(float) * (size_t)V * I);
    to_host(hw, w, (size_t)V * I);
    moe_backend_cpu.matmul_forward(ref, hh, hw, N, I, V);
    char what[96];
    snprintf(what, sizeof what, "logits16 V=%d: the GEMM's", V);
    report(what, mode, rel_err(L, ref, n) + st, bound);
    moe_backend_cpu.cross_entropy_forward(rl[0], rl[1], L, tg, N, V);
    moe_backend_cpu.cross_entropy_backward(ref, L, rl[1], tg, 0.01f, N, V);
    for (int k = 0; k < 2; k++) { /* the fused op; the forward and the backward */
        if (k == 0) {
            gpu->cross_entropy_fused(loss, lse, dl, lg, dtg, 0.01f, N, V);
        } else {
            gpu->cross_entropy_forward(loss, lse, lg, dtg, N, V);
            gpu->cross_entropy_backward(dl, lg, lse, dtg, 0.01f, N, V);
        }
        to_host(gl[0], loss, N);
        to_host(gl[1], lse, N);
        to_host(got, dl, n);
        snprintf(what, sizeof what, "logits16 V=%d: ce %s", V, k ? "fwd, bwd" : "fused");
        report(what, mode,
               rel_err(gl[0], rl[0], N) + rel_err(gl[1], rl[1], N) + rel_err(got, ref, n), 1e-5);
    }
    /* fused into a marked dlogits too (as the model runs it): 16-bit gradients */
    float *dl16 = gpu->alloc(sizeof(float) * n);
    const int st16 = gpu->mark_operand(dl16, n) != MOE_OK;
    gpu->cross_entropy_fused(loss, lse, dl16, lg, dtg, 0.01f, N, V);
    read_marked(p, got, dl16, n);
    to_host(gl[0], loss, N);
    snprintf(what, sizeof what, "logits16 V=%d: ce fused, dlogits16", V);
    report(what, mode, rel_err(gl[0], rl[0], N) + rel_err(got, ref, n) + st16, bound);
    gpu->mark_operand(dl16, 0);
    gpu->release(dl16);
    gpu->mark_operand(lg, 0);
    gpu->release(h);
    gpu->release(lg);
    gpu->release(dl);
    gpu->release(loss);
    gpu->release(lse);
    gpu->release(dtg);
    free(hh);
    free(L);
    free(ref);
    free(got);
    free(tg);
    free(hw);
}

/* RMSNorm forward (the attention's h1), the experts' permutation (xperm) and the
 * combine's backward (deout, the gradient of the experts' outputs: N rows of tokens rt,
 * slots r % 2 of 2, random weights) into buffers marked as holding their GEMM operand,
 * against unmarked ones; then the forward and backward GEMMs that read them (as
 * q = h1 Wq^T, ea = xperm W1^T, deh = deout W2). In a 16-bit precision
 * the marked ones hold the 16-bit values (bf16: bit for bit moe_bf16_round of the fp32
 * ones) and the GEMMs give the same bits; in fp32 nothing changes. D % 4 == 0 takes the
 * float4 kernels, otherwise the scalar ones. w: the arena, (O, D) weights at its start. */
static void check_writers_marked(moe_precision p, const char *mode, const float *w, int N, int D,
                                 int O)
{
    const size_t n = (size_t)N * D;
    float *hx = malloc(sizeof(float) * n), *hw = malloc(sizeof(float) * D),
          *hk = malloc(sizeof(float) * 2 * N);
    int32_t *rt = malloc(sizeof(int32_t) * 2 * N);
    fill(hx, n, 30, 2.0);
    fill(hw, D, 31, 1.0);
    fill(hk, 2 * (size_t)N, 32, 1.0);
    for (int r = 0; r < N; r++) { /* a permutation with repeats, as top-k rows */
        rt[r] = (int32_t)(moe_rng_u64(7, 32, (uint64_t)r) % (uint64_t)N);
        rt[N + r] = r % 2; /* the rows' slots */
    }
    float *kw = dev_copy(hk, 2 * (size_t)N);
    float *x = dev_copy(hx, n), *nw = dev_copy(hw, D), *rstd = gpu->alloc(sizeof(float) * N);
    float *dout = dev_copy(hx, n); /* an incoming gradient of (N, O) needs O <= D */
    int32_t *drt = gpu->alloc(sizeof(int32_t) * 2 * N);
    gpu->copy(drt, rt, sizeof(int32_t) * 2 * N, MOE_COPY_H2D);
    static const char *names[3] = {"rmsnorm", "permute", "combine_backward"};
    for (int which = 0; which < 3; which++) {
        float *o[2], *y[2], *gw[2];
        for (int k = 0; k < 2; k++) {
            o[k] = gpu->alloc(sizeof(float) * n);
            y[k] = gpu->alloc(sizeof(float) * (size_t)N * O);
            gw[k] = gpu->alloc(sizeof(float) * (size_t)O * D);
            gpu->zero(gw[k], sizeof(float) * (size_t)O * D);
        }
        int bad = gpu->mark_operand(o[1], n) != MOE_OK;
        for (int k = 0; k < 2; k++) {
            if (which == 0)
                gpu->rmsnorm_forward(o[k], rstd, x, nw, N, D, 1e-5f);
            else if (which == 1)
                gpu->moe_permute(o[k], x, drt, N, D);
            else
                gpu->moe_combine_backward(o[k], NULL, x, NULL, kw, drt, drt + N, N, D, 2);
            gpu->matmul_forward(y[k], o[k], w, N, D, O);
            gpu->matmul_backward(NULL, gw[k], dout, o[k], w, N, D, O, 0);
        }
        bad += (differ(o[0], o[1], n) != (p != MOE_PREC_FP32)) + bf16_mismatches(p, o[0], o[1], n);
        char what[96];
        snprintf(what, sizeof what, "%s D=%d: output %s", names[which], D,
                 p != MOE_PREC_FP32 ? "16-bit" : "same");
        report(what, mode, bad, 0.0);
        snprintf(what, sizeof what, "%s D=%d: GEMMs identical", names[which], D);
        report(what, mode, differ(y[0], y[1], (size_t)N * O) + differ(gw[0], gw[1], (size_t)O * D),
               0.0);
        gpu->mark_operand(o[1], 0);
        for (int k = 0; k < 2; k++) {
            gpu->release(o[k]);
            gpu->release(y[k]);
            gpu->release(gw[k]);
        }
    }
    gpu->release(x);
    gpu->release(nw);
    gpu->release(rstd);
    gpu->release(dout);
    gpu->release(drt);
    gpu->release(kw);
    free(hx);
    free(hw);
    free(hk);
    free(rt);
}

/* The combine from 16-bit expert outputs (marked, as the model marks eout): 2 N rows, row
 * m for token m % N and slot m / N, random weights; the forward (gathered through
 * slot_row and sorted) and the weights' gradient against the CPU's on the same (widened)
 * values. In fp32 nothing is marked. */
static void check_combine16(moe_precision p, const char *mode, int N, int D)
{
    if (p == MOE_PREC_FP32)
        return;
    const int K = 2, M = 2 * N;
    const size_t md = (size_t)M * D, nd = (size_t)N * D;
    float *he = malloc(sizeof(float) * md), *hw = malloc(sizeof(float) * N * K);
    float *hdy = malloc(sizeof(float) * nd), *ref = malloc(sizeof(float) * nd);
    float *got = malloc(sizeof(float) * nd), *rdw = calloc((size_t)N * K, sizeof(float));
    float *gdw = malloc(sizeof(float) * N * K);
    uint16_t *b16 = malloc(sizeof(uint16_t) * md);
    int32_t *map = malloc(sizeof(int32_t) * 3 * M); /* row_token, row_slot, slot_row */
    fill(he, md, 50, 1.0);
    fill(hw, (size_t)N * K, 51, 1.0);
    fill(hdy, nd, 52, 1.0);
    for (size_t i = 0; i < md; i++) {
        b16[i] = p == MOE_PREC_BF16 ? moe_bf16_round(he[i]) : moe_fp16_round(he[i]);
        he[i] = p == MOE_PREC_BF16 ? moe_bf16_widen(b16[i]) : moe_fp16_widen(b16[i]);
    }
    for (int m = 0; m < M; m++) {
        map[m] = m % N;
        map[M + m] = m / N;
        map[2 * M + (m % N) * K + m / N] = m;
    }
    float *e16 = gpu->alloc(sizeof(float) * md), *w = dev_copy(hw, (size_t)N * K);
    float *dy = dev_copy(hdy, nd), *y = gpu->alloc(sizeof(float) * nd);
    float *dw = dev_copy(rdw, (size_t)N * K);
    int32_t *dmap = gpu->alloc(sizeof(int32_t) * 3 * M);
    gpu->copy(e16, b16, sizeof(uint16_t) * md, MOE_COPY_H2D);
    gpu->copy(dmap, map, sizeof(int32_t) * 3 * M, MOE_COPY_H2D);
    int bad = gpu->mark_operand(e16, md) != MOE_OK;
    moe_backend_cpu.moe_combine_forward(ref, NULL, he, hw, map, map + M, M, D, K, NULL, N);
    moe_backend_cpu.moe_combine_backward(NULL, rdw, hdy, he, hw, map, map + M, M, D, K);
    char what[80];
    for (int gather = 0; gather < 2; gather++) {
        gpu->moe_combine_forward(y, NULL, e16, w, dmap, dmap + M, M, D, K,
                                 gather ? dmap + 2 * M : NULL, N);
        to_host(got, y, nd);
        snprintf(what, sizeof what, "combine 16-bit rows D=%d (%s)", D,
                 gather ? "gathered" : "sorted");
        report(what, mode, rel_err(got, ref, nd) + bad, 0.0);
    }
    gpu->moe_combine_backward(NULL, dw, dy, e16, w, dmap, dmap + M, M, D, K);
    to_host(gdw, dw, (size_t)N * K);
    snprintf(what, sizeof what, "combine_bwd 16-bit rows D=%d: dw", D);
    report(what, mode, rel_err(gdw, rdw, (size_t)N * K), 1e-6);
    /* both gradients in one call (one pass where D % 4 == 0): dexpert_out marked, as the
     * model's deout, holds the rounding of the fp32 products of an unmarked run, and dw
     * gets the same dots again (added to the first call's) */
    float *de32 = gpu->alloc(sizeof(float) * md), *de16 = gpu->alloc(sizeof(float) * md);
    bad += gpu->mark_operand(de16, md) != MOE_OK;
    gpu->moe_combine_backward(de16, dw, dy, e16, w, dmap, dmap + M, M, D, K);
    gpu->moe_combine_backward(de32, NULL, dy, e16, w, dmap, dmap + M, M, D, K);
    moe_backend_cpu.moe_combine_backward(NULL, rdw, hdy, he, hw, map, map + M, M, D, K);
    to_host(gdw, dw, (size_t)N * K);
    float *href = malloc(sizeof(float) * md), *hgot = malloc(sizeof(float) * md);
    moe_backend_cpu.moe_combine_backward(href, NULL, hdy, he, hw, map, map + M, M, D, K);
    to_host(hgot, de32, md);
    snprintf(what, sizeof what, "combine_bwd both D=%d: dexpert, dw", D);
    report(what, mode,
           rel_err(hgot, href, md) + round16_mismatches(p, de32, de16, md) + bad +
               rel_err(gdw, rdw, (size_t)N * K),
           1e-6);
    gpu->mark_operand(de16, 0);
    gpu->release(de16);
    gpu->release(de32);
    free(href);
    free(hgot);
    gpu->mark_operand(e16, 0);
    gpu->release(e16);
    gpu->release(w);
    gpu->release(dy);
    gpu->release(y);
    gpu->release(dw);
    gpu->release(dmap);
    free(he), free(hw), free(hdy), free(ref), free(got), free(rdw), free(gdw), free(b16);
    free(map);
}

/* Strided batches of 2 run so far by the one-by-one grouped GEMMs; calls of cuBLAS's
 * grouped form and GEMMs run one by one (matmul.cu). */
long moe_cuda_batched_pairs(void);
/* problems of two products run as one sum on the wgmma kernel (matmul.cu: the pair's dx) */
long moe_cuda_grouped_two_product_sums(void);
/* attention_backward_qkv calls whose kernels wrote [dq | dk | dv] themselves, and whether
 * the attention runs on the wgmma kernels here (attention.cu). */
long moe_cuda_attention_qkv_fused(void);
/* launches of the dsum kernel that reads 16-bit dout and out 8 values a load (attention.cu) */
long moe_cuda_attention_dsum8(void);
int moe_cuda_attention_wgmma(void);
/* launches of the 8-element SwiGLU kernels so far (swiglu.cu) */
long moe_cuda_swiglu_vec8_launches(void);
void moe_cuda_grouped_counts(long *grouped_calls, long *single_gemms);
/* launches of the wgmma grouped GEMM so far (matmul.cu: on sm_90 unless
 * MOE_GROUPED_GEMM=cublas) */
long moe_cuda_grouped_wgmma_launches(void);

/* The experts' gate and up projections as one op (grouped_matmul_forward_pair and its
 * backward): weights wa, wb = the arena's groups [0, G2) and [G2, 2 G2) (host w, device
 * dw_, each (G2, O, I)); the two outputs and the two output gradients lie in one buffer
 * each, O x N apart, the gradients marked as GEMM operands and written by SwiGLU's
 * backward, as in the model. Against the CPU's two grouped ops on the same values (the
 * output gradients: the unmarked fp32 SwiGLU backward, copied back), with dx and dw
 * written over NaN (write flags) and an empty group's slices zeroed. Where the GEMMs run
 * one by one (cuBLAS refuses its grouped form for 16-bit operands with fp32 outputs), each
 * group's two products must run as one strided batch, forward and backward. */
static void check_pair(const char *mode, double bound, const float *x, const float *w,
                       const float *dw_, const int *offsets, int G2, int N, int I, int O)
{
    const size_t no = (size_t)N * O, ni = (size_t)N * I, gw = (size_t)G2 * O * I;
    float *ha = malloc(sizeof(float) * no), *hb = malloc(sizeof(float) * no),
          *hdh = malloc(sizeof(float) * no), *ref = malloc(sizeof(float) * 2 * (no + gw)),
          *got = malloc(sizeof(float) * 2 * (no + gw)), *refx = malloc(sizeof(float) * ni),
          *gotx = malloc(sizeof(float) * ni), *nan_buf = malloc(sizeof(float) * 2 * gw);
    fill(ha, no, 21, 1.0);
    fill(hb, no, 22, 1.0);
    fill(hdh, no, 23, 1.0);
    memset(nan_buf, 0xff, sizeof(float) * 2 * gw);
    float *dx_ = dev_copy(x, ni), *da_in = dev_copy(ha, no), *db_in = dev_copy(hb, no),
          *ddh = dev_copy(hdh, no);
    float *outs = gpu->alloc(sizeof(float) * 2 * no), *g32 = gpu->alloc(sizeof(float) * 2 * no),
          *g16 = gpu->alloc(sizeof(float) * 2 * no), *dgx = dev_copy(nan_buf, ni),
          *dgw = dev_copy(nan_buf, 2 * gw);
    int st = gpu->mark_operand(g16, no) != MOE_OK || gpu->mark_operand(g16 + no, no) != MOE_OK;
    const long pairs0 = moe_cuda_batched_pairs(), wg0 = moe_cuda_grouped_wgmma_launches();
    long grouped0 = 0, grouped1 = 0, single = 0, two0 = 0;
    moe_cuda_grouped_counts(&grouped0, &single);
    char what[96];
    /* forward */
    gpu->grouped_matmul_forward_pair(outs, outs + no, dx_, dw_, dw_ + gw, offsets, G2, I, O);
    moe_backend_cpu.grouped_matmul_forward(ref, x, w, offsets, G2, I, O);
    moe_backend_cpu.grouped_matmul_forward(ref + no, x, w + gw, offsets, G2, I, O);
    to_host(got, outs, 2 * no);
    snprintf(what, sizeof what, "forward_pair (G=%d)", G2);
    report(what, mode, rel_err(got, ref, 2 * no), bound);
    /* backward: the output gradients as the model makes them */
    gpu->swiglu_backward(g32, g32 + no, ddh, da_in, db_in, no);
    gpu->swiglu_backward(g16, g16 + no, ddh, da_in, db_in, no);
    to_host(got, g32, 2 * no); /* the reference's output gradients */
    for (size_t i = 0; i < ni; i++)
        refx[i] = NAN;
    for (size_t i = 0; i < 2 * gw; i++)
        ref[2 * no + i] = NAN;
    moe_backend_cpu.grouped_matmul_backward(refx, ref + 2 * no, got, x, w, offsets, G2, I, O,
                                            MOE_WRITE_DW | MOE_WRITE_DX);
    moe_backend_cpu.grouped_matmul_backward(refx, ref + 2 * no + gw, got + no, x, w + gw, offsets,
                                            G2, I, O, MOE_WRITE_DW);
    two0 = moe_cuda_grouped_two_product_sums();
    gpu->grouped_matmul_backward_pair(dgx, dgw, dgw + gw, g16, g16 + no, dx_, dw_, dw_ + gw,
                                      offsets, G2, I, O, MOE_WRITE_DW | MOE_WRITE_DX);
    const long two = moe_cuda_grouped_two_product_sums() - two0;
    to_host(gotx, dgx, ni);
    to_host(got + 2 * no, dgw, 2 * gw);
    report("backward_pair dx", mode, rel_err(gotx, refx, ni), bound);
    report("backward_pair dw", mode, rel_err(got + 2 * no, ref + 2 * no, 2 * gw), bound);
    const long pairs = moe_cuda_batched_pairs() - pairs0;
    /* batches: one per non-empty group forward and one backward, where one by one */
    int groups = 0;
    for (int g = 0; g < G2; g++)
        groups += offsets[g + 1] > offsets[g];
    moe_cuda_grouped_counts(&grouped1, &single);
    /* none where cuBLAS's grouped call or the wgmma kernel ran them */
    const long wg = moe_cuda_grouped_wgmma_launches() - wg0;
    /* with MOE_GROUPED_WGMMA_CLASSES, the forward's (1) and the weight gradients' (4)
     * strided batches stay on cuBLAS where their class is not in the mask */
    const char *classes = getenv("MOE_GROUPED_WGMMA_CLASSES");
    const int mask = classes ? atoi(classes) : 7;
    const long want = grouped1 > grouped0 ? 0
                      : wg > 0            ? (long)groups * (!(mask & 1) + !(mask & 4))
                                          : 2L * groups;
    snprintf(what, sizeof what, "pair: %ld batches of 2 (want %ld)", pairs, want);
    report(what, mode, (double)(pairs != want) + st, 0.0);
    /* each non-empty group's dx as one sum of its two products where the input gradients
     * ran on the wgmma kernel (class 2 of the mask), else dx_b's added after */
    const long want_two = wg > 0 && (mask & 2) ? groups : 0;
    snprintf(what, sizeof what, "pair dx: %ld of two products as one sum (want %ld)", two,
             want_two);
    report(what, mode, (double)(two != want_two), 0.0);
    gpu->mark_operand(g16, 0);
    gpu->mark_operand(g16 + no, 0);
    gpu->release(dx_);
    gpu->release(da_in);
    gpu->release(db_in);
    gpu->release(ddh);
    gpu->release(outs);
    gpu->release(g32);
    gpu->release(g16);
    gpu->release(dgx);
    gpu->release(dgw);
    free(ha);
    free(hb);
    free(hdh);
    free(ref);
    free(got);
    free(refx);
    free(gotx);
    free(nan_buf);
}

/* n values of a device buffer that holds 16-bit values in a 16-bit precision (marked),
 * fp32 in fp32, as floats on the host. */
static void read_marked(moe_precision p, float *h, const void *d, size_t n)
{
    if (p == MOE_PREC_FP32) {
        to_host(h, d, n);
        return;
    }
    uint16_t *t = malloc(sizeof(uint16_t) * n);
    gpu->copy(t, d, sizeof(uint16_t) * n, MOE_COPY_D2H);
    for (size_t i = 0; i < n; i++)
        h[i] = p == MOE_PREC_BF16 ? moe_bf16_widen(t[i]) : moe_fp16_widen(t[i]);
    free(t);
}

long moe_cuda_swiglu_epilogue_launches(void);
static int cc_main; /* the GPU's compute capability (main) */

/* grouped_matmul_forward_pair_swiglu into outputs marked as 16-bit, as the model's ea, eb
 * and eh (fp32 ones in fp32), filled with NaN first: with MOE_SWIGLU_EPILOGUE=1 (on
 * compute capability 9.0 in 16 bits, h computed in the wgmma kernel's epilogue: one
 * launch per 32 non-empty groups, and no SwiGLU kernel) against the op without it (the
 * pair, then SwiGLU's kernel): the same bits in all three outputs, and no value left
 * unstored. Weights: the arena's groups [0, G) and [G, 2 G) as (G, O, I). */
static void check_pair_swiglu(moe_precision p, const char *mode, const float *dx_, const float *dw_,
                              const int *offsets, int G, int N, int I, int O)
{
    const size_t no = (size_t)N * O, elem = p == MOE_PREC_FP32 ? 4 : 2;
    float *nan_buf = malloc(sizeof(float) * 3 * no), *o[2];
    unsigned char *bits[2];
    memset(nan_buf, 0xff, sizeof(float) * 3 * no);
    int st = 0, groups = 0;
    for (int g = 0; g < G; g++)
        groups += offsets[g + 1] > offsets[g];
    const char *classes = getenv("MOE_GROUPED_WGMMA_CLASSES");
    const char *path = getenv("MOE_GROUPED_GEMM");
    const int on = cc_main == 90 && p != MOE_PREC_FP32 && (!classes || (atoi(classes) & 1)) &&
                   !(path && strcmp(path, "cublas") == 0);
    long launches[2], vec8[2];
    for (int form = 0; form < 2; form++) {
        o[form] = dev_copy(nan_buf, 3 * no);
        for (int c = 0; c < 3; c++)
            st += gpu->mark_operand(o[form] + c * no, no) != MOE_OK;
        if (form)
            setenv("MOE_SWIGLU_EPILOGUE", "1", 1);
        else
            unsetenv("MOE_SWIGLU_EPILOGUE");
        const long l0 = moe_cuda_swiglu_epilogue_launches(), v0 = moe_cuda_swiglu_vec8_launches();
        gpu->grouped_matmul_forward_pair_swiglu(o[form] + 2 * no, o[form], o[form] + no, dx_, dw_,
                                                dw_ + (size_t)G * O * I, offsets, G, I, O);
        launches[form] = moe_cuda_swiglu_epilogue_launches() - l0;
        vec8[form] = moe_cuda_swiglu_vec8_launches() - v0;
        unsetenv("MOE_SWIGLU_EPILOGUE");
        bits[form] = malloc(elem * 3 * no);
        for (int c = 0; c < 3; c++)
            gpu->copy(bits[form] + elem * c * no, o[form] + c * no, elem * no, MOE_COPY_D2H);
        for (int c = 0; c < 3; c++)
            gpu->mark_operand(o[form] + c * no, 0);
    }
    size_t unstored = 0; /* NaN: all bits 1 (random inputs make none) */
    for (size_t i = 0; i < elem * 3 * no; i += elem)
        unstored += (elem == 2 ? *(const uint16_t *)(bits[1] + i) == 0xffff
                               : *(const uint32_t *)(bits[1] + i) == 0xffffffffu);
    size_t differ3[3] = {0, 0, 0}; /* values of out a, out b, h whose bits differ */
    for (size_t i = 0; i < 3 * no; i++)
        differ3[i / no] += memcmp(bits[0] + elem * i, bits[1] + elem * i, elem) != 0;
    char what[128];
    snprintf(what, sizeof what,
             "pair+swiglu epilogue = two ops, bits (G=%d; differ a %zu b %zu h %zu; %zu unstored)",
             G, differ3[0], differ3[1], differ3[2], unstored);
    report(what, mode, (double)(differ3[0] + differ3[1] + differ3[2] + unstored), 0.0);
    const long want = on ? (groups + 31) / 32 : 0;
    snprintf(what, sizeof what,
             "pair+swiglu epilogue: %ld launches (want %ld), swiglu kernels %ld then %ld",
             launches[1], want, vec8[0], vec8[1]);
    report(what, mode,
           (double)(launches[0] != 0 || launches[1] != want || (on && vec8[1] != 0)) + st, 0.0);
    for (int form = 0; form < 2; form++) {
        gpu->release(o[form]);
        free(bits[form]);
    }
    free(nan_buf);
}

/* GEMM outputs marked as 16-bit (the experts' ea, eb and deh): the pair's forward writes
 * both outputs and the grouped backward its dx (written, MOE_WRITE_DX) in 16 bits, each
 * against the CPU's products (the bound of the mode); SwiGLU forward and backward read
 * those 16-bit a, b, dh, against the CPU's SwiGLU of the same (widened) values within
 * 1e-5. In fp32 the marks change nothing (the buffers hold fp32). Weights: the arena's
 * groups [0, 2 G2) as (G2, O, I) twice, and its start as (G2, I, O) for the backward. */
static void check_outputs16(moe_precision p, const char *mode, double bound, const float *x,
                            const float *w, const float *dw_, const int *offsets, int G2, int N,
                            int I, int O)
{
    const size_t no = (size_t)N * O, ni = (size_t)N * I, gw = (size_t)G2 * O * I;
    float *ab = gpu->alloc(sizeof(float) * 2 * no), *dh = gpu->alloc(sizeof(float) * no),
          *h = gpu->alloc(sizeof(float) * no), *da = gpu->alloc(sizeof(float) * 2 * no),
          *dx_ = dev_copy(x, ni);
    int st = gpu->mark_operand(ab, no) != MOE_OK || gpu->mark_operand(ab + no, no) != MOE_OK ||
             gpu->mark_operand(dh, no) != MOE_OK;
    float *ref = malloc(sizeof(float) * 4 * no), *got = malloc(sizeof(float) * 4 * no),
          *hab = malloc(sizeof(float) * 3 * no);
    /* gate and up: (N, I) x (G2, O, I) twice -> ab (N, O) twice, 16-bit */
    gpu->grouped_matmul_forward_pair(ab, ab + no, dx_, dw_, dw_ + gw, offsets, G2, I, O);
    moe_backend_cpu.grouped_matmul_forward(ref, x, w, offsets, G2, I, O);
    moe_backend_cpu.grouped_matmul_forward(ref + no, x, w + gw, offsets, G2, I, O);
    read_marked(p, hab, ab, no);
    read_marked(p, hab + no, ab + no, no);
    report("marked out: forward_pair", mode, rel_err(hab, ref, 2 * no), bound);
    /* dh (N, O) = dout (N, I) W, W the arena's start as (G2, I, O): written, 16-bit */
    gpu->grouped_matmul_backward(dh, NULL, dx_, NULL, dw_, offsets, G2, O, I, MOE_WRITE_DX);
    for (size_t i = 0; i < no; i++)
        ref[i] = NAN;
    moe_backend_cpu.grouped_matmul_backward(ref, NULL, x, NULL, w, offsets, G2, O, I, MOE_WRITE_DX);
    read_marked(p, hab + 2 * no, dh, no);
    report("marked out: grouped dx written", mode, rel_err(hab + 2 * no, ref, no), bound);
    /* SwiGLU from the 16-bit a, b (and dh) against the CPU's on the same values */
    gpu->swiglu_forward(h, ab, ab + no, no);
    gpu->swiglu_backward(da, da + no, dh, ab, ab + no, no);
    moe_backend_cpu.swiglu_forward(ref, hab, hab + no, no);
    moe_backend_cpu.swiglu_backward(ref + no, ref + 2 * no, hab + 2 * no, hab, hab + no, no);
    to_host(got, h, no);
    to_host(got + no, da, 2 * no);
    report("swiglu from 16-bit a, b", mode, rel_err(got, ref, no), 1e-5);
    report("swiglu_backward from 16-bit", mode, rel_err(got + no, ref + no, 2 * no), 1e-5);
    /* and into 16-bit outputs (the model's eh, dea, deb): the 8-element form (16-byte
     * accesses) against the 4-element one (MOE_SWIGLU_VEC=4) bit for bit, and against the
     * CPU within the output's rounding */
    float *o16 = gpu->alloc(sizeof(float) * 3 * no);
    uint16_t *bits = malloc(sizeof(uint16_t) * 6 * no);
    for (int c = 0; c < 3; c++)
        st += gpu->mark_operand(o16 + c * no, no) != MOE_OK;
    long vec8[2]; /* the 8-element launches each form made: 2, then none */
    for (int form = 0; form < 2; form++) {
        if (form)
            setenv("MOE_SWIGLU_VEC", "4", 1);
        const long before = moe_cuda_swiglu_vec8_launches();
        gpu->swiglu_forward(o16, ab, ab + no, no);
        gpu->swiglu_backward(o16 + no, o16 + 2 * no, dh, ab, ab + no, no);
        vec8[form] = moe_cuda_swiglu_vec8_launches() - before;
        unsetenv("MOE_SWIGLU_VEC");
        for (int c = 0; c < 3 && p != MOE_PREC_FP32; c++)
            gpu->copy(bits + (size_t)(3 * form + c) * no, o16 + c * no, sizeof(uint16_t) * no,
                      MOE_COPY_D2H);
    }
    if (p != MOE_PREC_FP32) {
        report("swiglu 16-bit out: 8 = 4 a thread", mode,
               memcmp(bits, bits + 3 * no, sizeof(uint16_t) * 3 * no) != 0, 0.0);
        report("swiglu 16-bit out: the 8-element form ran, then the 4-element", mode,
               vec8[0] != 2 || vec8[1] != 0, 0.0);
        for (int c = 0; c < 3; c++)
            read_marked(p, got + c * no, o16 + c * no, no);
        report("swiglu 16-bit out vs cpu", mode, rel_err(got, ref, 3 * no),
               p == MOE_PREC_BF16 ? 0x1p-8 : 0x1p-11); /* the unit roundoff */
    }
    for (int c = 0; c < 3; c++)
        gpu->mark_operand(o16 + c * no, 0);
    gpu->release(o16);
    free(bits);
    /* the q, k, v projections' batch: three marked outputs one after another (x2 the
     * products' gap: a stride of 2 no), the arena's start as (3, O, I); each against the
     * CPU's product */
    float *qkv = gpu->alloc(sizeof(float) * 5 * no);
    for (int c = 0; c < 3; c++)
        st += gpu->mark_operand(qkv + 2 * c * no, no) != MOE_OK;
    gpu->matmul_forward_batch(qkv, 2 * no, dx_, dw_, 3, N, I, O);
    double err = 0;
    for (int c = 0; c < 3; c++) {
        moe_backend_cpu.matmul_forward(ref, x, w + (size_t)c * O * I, N, I, O);
        read_marked(p, got, qkv + 2 * c * no, no);
        const double e = rel_err(got, ref, no);
        err = e > err ? e : err;
        gpu->mark_operand(qkv + 2 * c * no, 0);
    }
    report("marked out: matmul_forward_batch of 3", mode, err, bound);
    gpu->release(qkv);
    report("marked out: marks taken", mode, st, 0.0);
    gpu->mark_operand(ab, 0);
    gpu->mark_operand(ab + no, 0);
    gpu->mark_operand(dh, 0);
    gpu->release(ab);
    gpu->release(dh);
    gpu->release(h);
    gpu->release(da);
    gpu->release(dx_);
    free(ref);
    free(got);
    free(hab);
}

/* The grouped linear at sizes where each problem has several tiles of 128 x 256 and k
 * several slices of 64, with tails in each (rows 130 .. 679 a group, one group empty,
 * O = 576 = 2.25 x 256): forward, and backward written over NaN (the empty group's dw
 * zeroed) then added to, against the CPU. */
static void check_grouped_large(moe_precision p, const char *mode, double bound)
{
    const int G = 6, N = 1500, I = 264, O = 576;
    const int offsets[7] = {0, 130, 130, 611, 700, 1379, 1500};
    const size_t nw = (size_t)G * O * I, ni = (size_t)N * I, no = (size_t)N * O;
    float *w = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * ni),
          *dout = malloc(sizeof(float) * no), *ref = malloc(sizeof(float) * (nw + no)),
          *got = malloc(sizeof(float) * (nw + no)), *refx = malloc(sizeof(float) * ni),
          *gotx = malloc(sizeof(float) * ni);
    fill(w, nw, 31, 0.05);
    fill(x, ni, 32, 1.0);
    fill(dout, no, 33, 1.0);
    float *dw_ = dev_copy(w, nw), *dx_ = dev_copy(x, ni), *ddout = dev_copy(dout, no);
    float *out = gpu->alloc(sizeof(float) * no), *dgx = gpu->alloc(sizeof(float) * ni),
          *dgw = gpu->alloc(sizeof(float) * nw);
    if (gpu->set_precision(p, dw_, nw, no) != MOE_OK || gpu->refresh_shadow() != MOE_OK) {
        printf("FAIL %s: set_precision\n", mode);
        failures++;
        return;
    }
    moe_backend_cpu.grouped_matmul_forward(ref, x, w, offsets, G, I, O);
    gpu->grouped_matmul_forward(out, dx_, dw_, offsets, G, I, O);
    to_host(got, out, no);
    report("grouped_forward large", mode, rel_err(got, ref, no), bound);
    /* into a marked buffer: 16-bit outputs (the wgmma kernel's tails of a stored tile) */
    float *o16 = gpu->alloc(sizeof(float) * no);
    const int st16 = gpu->mark_operand(o16, no) != MOE_OK;
    gpu->grouped_matmul_forward(o16, dx_, dw_, offsets, G, I, O);
    read_marked(p, got, o16, no);
    report("grouped_forward large 16-bit", mode, st16 ? 1.0 : rel_err(got, ref, no), bound);
    gpu->mark_operand(o16, 0);
    gpu->release(o16);
    for (size_t i = 0; i < nw || i < ni; i++) {
        if (i < nw)
            got[i] = ref[i] = NAN;
        if (i < ni)
            gotx[i] = refx[i] = NAN;
    }
    moe_backend_cpu.grouped_matmul_backward(refx, ref, dout, x, w, offsets, G, I, O,
                                            MOE_WRITE_DW | MOE_WRITE_DX);
    gpu->copy(dgw, got, sizeof(float) * nw, MOE_COPY_H2D);
    gpu->copy(dgx, gotx, sizeof(float) * ni, MOE_COPY_H2D);
    gpu->grouped_matmul_backward(dgx, dgw, ddout, dx_, dw_, offsets, G, I, O,
                                 MOE_WRITE_DW | MOE_WRITE_DX);
    to_host(got, dgw, nw);
    to_host(gotx, dgx, ni);
    report("grouped_backward large dw", mode, rel_err(got, ref, nw), bound);
    report("grouped_backward large dx", mode, rel_err(gotx, refx, ni), bound);
    /* added to: the same again on top doubles both */
    gpu->grouped_matmul_backward(dgx, dgw, ddout, dx_, dw_, offsets, G, I, O, 0);
    to_host(got, dgw, nw);
    to_host(gotx, dgx, ni);
    for (size_t i = 0; i < nw || i < ni; i++) {
        if (i < nw)
            ref[i] *= 2;
        if (i < ni)
            refx[i] *= 2;
    }
    report("grouped_backward large dw +=", mode, rel_err(got, ref, nw), bound);
    report("grouped_backward large dx +=", mode, rel_err(gotx, refx, ni), bound);
    gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0);
    gpu->release(dw_);
    gpu->release(dx_);
    gpu->release(ddout);
    gpu->release(out);
    gpu->release(dgx);
    gpu->release(dgw);
    free(w), free(x), free(dout), free(ref), free(got), free(refx), free(gotx);
}

static void check_mode(moe_precision p, const char *mode, double bound)
{
    const int N = 301, I = 160, O = 224, G = 5;
    const int offsets[6] = {0, 40, 40, 151, 290, 301}; /* an empty group */
    const size_t nw = (size_t)G * O * I;
    float *w = malloc(sizeof(float) * nw), *x = malloc(sizeof(float) * N * I),
          *dout = malloc(sizeof(float) * N * O), *ref = malloc(sizeof(float) * nw),
          *got = malloc(sizeof(float) * nw), *refx = malloc(sizeof(float) * N * I),
          *gotx = malloc(sizeof(float) * N * I);
    fill(w, nw, 1, 0.05);
    fill(x, (size_t)N * I, 2, 1.0);
    fill(dout, (size_t)N * O, 3, 1.0);
    float *dw_ = dev_copy(w, nw), *dx_ = dev_copy(x, (size_t)N * I),
          *ddout = dev_copy(dout, (size_t)N * O);
    float *dout_buf = gpu->alloc(sizeof(float) * N * O), *dgx = gpu->alloc(sizeof(float) * N * I),
          *dgw = gpu->alloc(sizeof(float) * nw);
    if (gpu->set_precision(p, dw_, nw, (size_t)N * (I > O ? I : O)) != MOE_OK ||
        gpu->refresh_shadow() != MOE_OK) {
        printf("FAIL %s: set_precision\n", mode);
        failures++;
        return;
    }
    char what[64];
    /* forward: out = x W0^T */
    moe_backend_cpu.matmul_forward(ref, x, w, N, I, O);
    gpu->matmul_forward(dout_buf, dx_, dw_, N, I, O);
    to_host(got, dout_buf, (size_t)N * O);
    report("matmul_forward", mode, rel_err(got, ref, (size_t)N * O), bound);
    /* backward: dx, dw (+= into zero) */
    memset(refx, 0, sizeof(float) * N * I);
    memset(ref, 0, sizeof(float) * nw);
    moe_backend_cpu.matmul_backward(refx, ref, dout, x, w, N, I, O, 0);
    gpu->zero(dgx, sizeof(float) * N * I);
    gpu->zero(dgw, sizeof(float) * nw);
    gpu->matmul_backward(dgx, dgw, ddout, dx_, dw_, N, I, O, 0);
    to_host(gotx, dgx, (size_t)N * I);
    report("matmul_backward dx", mode, rel_err(gotx, refx, (size_t)N * I), bound);
    to_host(got, dgw, (size_t)O * I);
    report("matmul_backward dw", mode, rel_err(got, ref, (size_t)O * I), bound);
    /* grouped */
    moe_backend_cpu.grouped_matmul_forward(ref, x, w, offsets, G, I, O);
    gpu->grouped_matmul_forward(dout_buf, dx_, dw_, offsets, G, I, O);
    to_host(got, dout_buf, (size_t)N * O);
    snprintf(what, sizeof what, "grouped_forward (G=%d)", G);
    report(what, mode, rel_err(got, ref, (size_t)N * O), bound);
    memset(refx, 0, sizeof(float) * N * I);
    memset(ref, 0, sizeof(float) * nw);
    moe_backend_cpu.grouped_matmul_backward(refx, ref, dout, x, w, offsets, G, I, O, 0);
    gpu->zero(dgx, sizeof(float) * N * I);
    gpu->zero(dgw, sizeof(float) * nw);
    gpu->grouped_matmul_backward(dgx, dgw, ddout, dx_, dw_, offsets, G, I, O, 0);
    to_host(gotx, dgx, (size_t)N * I);
    report("grouped_backward dx", mode, rel_err(gotx, refx, (size_t)N * I), bound);
    to_host(got, dgw, nw);
    report("grouped_backward dw", mode, rel_err(got, ref, nw), bound);
    /* the empty group's weight gradient stays untouched (zero) */
    double empty = 0;
    for (size_t i = (size_t)O * I; i < (size_t)2 * O * I; i++)
        empty += fabs(got[i]);
    report("grouped empty group untouched", mode, empty, 0.0);
    /* written: dx and dw over NaN (so never read), the empty group's dw slice zeroed */
    for (size_t i = 0; i < nw || i < (size_t)N * I; i++) {
        if (i < nw)
            got[i] = NAN;
        if (i < (size_t)N * I)
            gotx[i] = NAN;
    }
    gpu->copy(dgw, got, sizeof(float) * nw, MOE_COPY_H2D);
    gpu->copy(dgx, gotx, sizeof(float) * N * I, MOE_COPY_H2D);
    gpu->grouped_matmul_backward(dgx, dgw, ddout, dx_, dw_, offsets, G, I, O,
                                 MOE_WRITE_DW | MOE_WRITE_DX);
    to_host(got, dgw, nw);
    report("grouped_backward dw written", mode, rel_err(got, ref, nw), bound);
    to_host(gotx, dgx, (size_t)N * I);
    report("grouped_backward dx written", mode, rel_err(gotx, refx, (size_t)N * I), bound);
    check_in_place(p, mode, x, dw_, offsets, N, I, O, G);
    const int pair_offsets[2][3] = {{0, 140, 301}, {0, 0, 301}}; /* the second: one empty */
    check_pair(mode, bound, x, w, dw_, pair_offsets[0], 2, N, I, O);
    check_pair(mode, bound, x, w, dw_, pair_offsets[1], 2, N, I, O);
    check_outputs16(p, mode, bound, x, w, dw_, pair_offsets[0], 2, N, I, O);
    check_outputs16(p, mode, bound, x, w, dw_, pair_offsets[1], 2, N, I, O);
    check_pair_swiglu(p, mode, dx_, dw_, pair_offsets[0], 2, N, I, O);
    check_pair_swiglu(p, mode, dx_, dw_, pair_offsets[1], 2, N, I, O);
    { /* 40 groups (two launches of the epilogue's kernel), one empty, rows 0 .. 14 */
        int off40[41];
        for (int g = 0; g <= 40; g++)
            off40[g] = (g == 8 ? 7 : g) * N / 40; /* group 7 empty */
        check_pair_swiglu(p, mode, dx_, dw_, off40, 40, N, 32, 24);
    }
    check_ce_in_place(p, mode, dw_, 60, 1000, I); /* (V, I) weights: the arena's start */
    check_ce_in_place(p, mode, dw_, 60, 999, I);
    check_ce_logits16(p, mode, bound, dw_, 60, 1000, I); /* (V, I) weights: the arena */
    check_ce_logits16(p, mode, bound, dw_, 60, 999, I);
    /* rows longer than the fused kernel keeps in registers (32768 16-bit logits): the
     * rest read again; (V, 4) weights still fit the arena */
    check_ce_logits16(p, mode, bound, dw_, 8, 40000, 4);
    check_writers_marked(p, mode, dw_, 70, 160, 120); /* (O, D) weights: the arena's start */
    check_writers_marked(p, mode, dw_, 70, 150, 120);
    check_combine16(p, mode, 37, 64); /* float4 reads of 4 values */
    check_combine16(p, mode, 37, 30); /* one by one */
    if (gpu->sync() != MOE_OK) {
        printf("FAIL %s: the backend reported an error\n", mode);
        failures++;
    }
    gpu->release(dw_);
    gpu->release(dx_);
    gpu->release(ddout);
    gpu->release(dout_buf);
    gpu->release(dgx);
    gpu->release(dgw);
    free(w);
    free(x);
    free(dout);
    free(ref);
    free(got);
    free(refx);
    free(gotx);
}

/* The count of values of h (n floats) that are not bf16 values (low 16 bits not zero). */
static size_t not_bf16(const float *h, size_t n)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b;
        memcpy(&b, &h[i], sizeof b);
        bad += (b & 0xffffu) != 0;
    }
    return bad;
}

/* bf16 gradients of bf16 master weights (grads_in_shadow), bf16 mode. An arena of nd
 * dense parameters, then the experts' wa, wb (G, O, I) each, bf16 master weights from
 * nd; a gradient arena like it whose expert part holds a sentinel (NaN) in fp32. The
 * GEMMs write the expert weight gradients in the bf16 copy: the grouped backward
 * (written, an empty group's slice zeroed; then added to) and the pair backward (one
 * strided batch of 2 per non-empty group, 4) against the CPU's products (bound 1e-2), the results
 * bf16 values; the fp32 copies never written (the sentinel's bytes stay) until sync_master widens
 * the bf16 ones into them. The sums of squares and the finiteness check over them read the bf16
 * values (the sum against the host's double sum of the widened values, 1e-12 relative; an infinity
 * added by a GEMM is found). AdamW over the arena reads them: the sums of squares out of its pass,
 * and the bf16 moments bit for bit, against the CPU's AdamW given the widened gradients (the
 * sentinel would make them NaN). */
static void check_grads16(void)
{
    const int N = 301, I = 160, O = 224, G = 5;
    const int offsets[6] = {0, 40, 40, 151, 290, 301}; /* group 1 empty */
    const size_t nd = 1000, gw = (size_t)G * O * I, n = nd + 2 * gw, ni = (size_t)N * I,
                 no = (size_t)N * O;
    float *hp = malloc(sizeof(float) * n), *hg = malloc(sizeof(float) * n),
          *x = malloc(sizeof(float) * ni), *hdh = malloc(sizeof(float) * no),
          *ha = malloc(sizeof(float) * no), *hb = malloc(sizeof(float) * no),
          *ref = malloc(sizeof(float) * 2 * gw), *got = malloc(sizeof(float) * n),
          *gd = malloc(sizeof(float) * 2 * no), *refx = malloc(sizeof(float) * ni);
    fill(hp, n, 31, 0.05);
    for (size_t i = nd; i < n; i++) /* bf16 master weights are bf16 values */
        hp[i] = moe_bf16_widen(moe_bf16_round(hp[i]));
    fill(hg, nd, 32, 1.0);
    for (size_t i = nd; i < n; i++)
        hg[i] = NAN;
    fill(x, ni, 33, 1.0);
    fill(hdh, no, 34, 1.0);
    fill(ha, no, 35, 1.0);
    fill(hb, no, 36, 1.0);
    float *dp = dev_copy(hp, n), *dg = dev_copy(hg, n), *dx_ = dev_copy(x, ni),
          *ddh = dev_copy(hdh, no), *da_in = dev_copy(ha, no), *db_in = dev_copy(hb, no);
    float *d16 = gpu->alloc(sizeof(float) * 2 * no), *d32 = gpu->alloc(sizeof(float) * 2 * no),
          *dgx = gpu->alloc(sizeof(float) * ni);
    float *wa = hp + nd, *wb = hp + nd + gw, *ga = dg + nd, *gb = dg + nd + gw;
    if (gpu->set_precision(MOE_PREC_BF16, dp, n, ni > no ? ni : no) != MOE_OK ||
        gpu->master_in_shadow(nd) != MOE_OK || gpu->refresh_shadow() != MOE_OK ||
        gpu->grads_in_shadow(dg) != MOE_OK || gpu->mark_operand(d16, no) != MOE_OK ||
        gpu->mark_operand(d16 + no, no) != MOE_OK) {
        printf("FAIL grads16: set_precision, master_in_shadow, grads_in_shadow\n");
        failures++;
        return;
    }
    /* the output gradients as the model makes them: SwiGLU's backward, 16-bit (marked)
     * for the GEMMs, fp32 for the reference */
    gpu->swiglu_backward(d16, d16 + no, ddh, da_in, db_in, no);
    gpu->swiglu_backward(d32, d32 + no, ddh, da_in, db_in, no);
    to_host(gd, d32, 2 * no);
    /* the grouped backward of wa from gradient a: written, then gradient b's added */
    for (size_t i = 0; i < gw; i++)
        ref[i] = NAN;
    moe_backend_cpu.grouped_matmul_backward(NULL, ref, gd, x, wa, offsets, G, I, O, MOE_WRITE_DW);
    gpu->grouped_matmul_backward(NULL, ga, d32, dx_, dp + nd, offsets, G, I, O, MOE_WRITE_DW);
    to_host(got, dg, n);
    size_t sentinel = 0;
    for (size_t i = nd; i < n; i++)
        sentinel += !isnan(got[i]);
    report("grads16: fp32 copies untouched", "bf16", (double)sentinel, 0.0);
    gpu->sync_master();
    to_host(got, ga, gw);
    report("grads16: grouped dw written", "bf16", rel_err(got, ref, gw), 1e-2);
    double empty = 0;
    for (size_t i = (size_t)O * I; i < (size_t)2 * O * I; i++)
        empty += fabs(got[i]);
    report("grads16: empty group zeroed", "bf16", empty + (double)not_bf16(got, gw), 0.0);
    moe_backend_cpu.grouped_matmul_backward(NULL, ref, gd + no, x, wa, offsets, G, I, O, 0);
    gpu->grouped_matmul_backward(NULL, ga, d32 + no, dx_, dp + nd, offsets, G, I, O, 0);
    gpu->sync_master();
    to_host(got, ga, gw);
    report("grads16: grouped dw added to", "bf16",
           rel_err(got, ref, gw) + (double)not_bf16(got, gw), 1e-2);
    /* the pair: both weight gradients, one strided batch of 2 per non-empty group on
     * cuBLAS, none where the wgmma kernel ran them (sm_90) */
    const long pairs0 = moe_cuda_batched_pairs(), wg0 = moe_cuda_grouped_wgmma_launches();
    for (size_t i = 0; i < ni; i++)
        refx[i] = NAN;
    for (size_t i = 0; i < 2 * gw; i++)
        ref[i] = NAN;
    moe_backend_cpu.grouped_matmul_backward(refx, ref, gd, x, wa, offsets, G, I, O,
                                            MOE_WRITE_DW | MOE_WRITE_DX);
    moe_backend_cpu.grouped_matmul_backward(refx, ref + gw, gd + no, x, wb, offsets, G, I, O,
                                            MOE_WRITE_DW);
    gpu->grouped_matmul_backward_pair(dgx, ga, gb, d16, d16 + no, dx_, dp + nd, dp + nd + gw,
                                      offsets, G, I, O, MOE_WRITE_DW | MOE_WRITE_DX);
    const long pairs = moe_cuda_batched_pairs() - pairs0,
               want_pairs = moe_cuda_grouped_wgmma_launches() > wg0 ? 0 : 4;
    gpu->sync_master();
    to_host(got, ga, 2 * gw);
    report("grads16: pair dw", "bf16", rel_err(got, ref, 2 * gw) + (double)not_bf16(got, 2 * gw),
           1e-2);
    char what[64];
    snprintf(what, sizeof what, "grads16: %ld batches of 2 (want %ld)", pairs, want_pairs);
    report(what, "bf16", pairs != want_pairs ? 1.0 : 0.0, 0.0);
    /* the sums over them (the bf16 values, widened: got holds them) */
    double want = 0;
    for (size_t i = 0; i < 2 * gw; i++)
        want += (double)got[i] * got[i];
    const double have = gpu->sum_squares(ga, 2 * gw);
    report("grads16: sum_squares", "bf16", fabs(have - want) / want, 1e-12);
    /* AdamW over the arena: bf16 moments, the sums of squares from its pass */
    const size_t split = nd;
    float *hm = malloc(sizeof(float) * n), *hv = malloc(sizeof(float) * n);
    fill(hm, n, 37, 0.01);
    fill(hv, n, 38, 0.001);
    uint16_t *m16 = (uint16_t *)hm, *v16 = (uint16_t *)hv;
    for (size_t i = 0; i < n; i++) {
        m16[i] = moe_bf16_round(hm[i]);
        v16[i] = moe_bf16_round(fabsf(hv[i]));
    }
    float *dm = dev_copy(hm, n), *dv = dev_copy(hv, n);
    const int64_t off[3] = {0, (int64_t)nd, (int64_t)n};
    const float wd[2] = {0.0f, 0.1f};
    int64_t *doff = gpu->alloc(sizeof off);
    float *dwd = gpu->alloc(sizeof wd);
    double *dsq = gpu->alloc(2 * sizeof(double)), sq_ref[2], sq_got[2];
    gpu->copy(doff, off, sizeof off, MOE_COPY_H2D);
    gpu->copy(dwd, wd, sizeof wd, MOE_COPY_H2D);
    to_host(hg, dg, nd); /* the dense gradients as the GPU holds them; the experts': got */
    memcpy(hg + nd, got, sizeof(float) * 2 * gw);
    moe_backend_cpu.adamw_update_multi(hp, hg, hm, hv, 1, n, 0, n, off, wd, 2, 1e-3f, 0.9f, 0.95f,
                                       1e-8f, NULL, 0.0, 1.0, 3, sq_ref, split);
    gpu->adamw_update_multi(dp, dg, dm, dv, 1, n, 0, n, doff, dwd, 2, 1e-3f, 0.9f, 0.95f, 1e-8f,
                            NULL, 0.0, 1.0, 3, dsq, split);
    gpu->copy(sq_got, dsq, sizeof sq_got, MOE_COPY_D2H);
    const double sq_err =
        fabs(sq_got[0] - sq_ref[0]) / sq_ref[0] + fabs(sq_got[1] - sq_ref[1]) / sq_ref[1];
    report("grads16: adamw's sums of squares", "bf16", sq_err, 1e-12);
    uint16_t *gm = malloc(sizeof(uint16_t) * n), *gv = malloc(sizeof(uint16_t) * n);
    gpu->copy(gm, dm, sizeof(uint16_t) * n, MOE_COPY_D2H);
    gpu->copy(gv, dv, sizeof(uint16_t) * n, MOE_COPY_D2H);
    report("grads16: adamw's bf16 moments bit for bit", "bf16",
           (double)(memcmp(gm, m16, sizeof(uint16_t) * n) != 0) +
               (memcmp(gv, v16, sizeof(uint16_t) * n) != 0),
           0.0);
    /* an infinity in the bf16 copy: a product added to it, found by all_finite */
    float *inf_x = malloc(sizeof(float) * ni);
    memcpy(inf_x, x, sizeof(float) * ni);
    inf_x[5] = INFINITY;
    float *dinf = dev_copy(inf_x, ni);
    const int finite_before = gpu->all_finite(gb, gw);
    gpu->grouped_matmul_backward(NULL, gb, d32, dinf, dp + nd + gw, offsets, G, I, O, 0);
    report("grads16: all_finite reads the bf16 copy", "bf16",
           (double)(finite_before != 1) + (gpu->all_finite(gb, gw) != 0) +
               (gpu->all_finite(ga, gw) != 1) + (gpu->all_finite(dg, nd) != 1),
           0.0);
    if (gpu->sync() != MOE_OK) {
        printf("FAIL grads16: the backend reported an error\n");
        failures++;
    }
    gpu->mark_operand(d16, 0);
    gpu->mark_operand(d16 + no, 0);
    gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0);
    void *dev[] = {dp, dg, dx_, ddh, da_in, db_in, d16, d32, dgx, dm, dv, doff, dwd, dsq, dinf};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        gpu->release(dev[i]);
    void *host[] = {hp, hg, x, hdh, ha, hb, ref, got, gd, refx, hm, hv, gm, gv, inf_x};
    for (size_t i = 0; i < sizeof host / sizeof host[0]; i++)
        free(host[i]);
}

/* Causal attention (B, T, H, Hd) in precision p, forward (out, lse) and backward (dq, dk,
 * dv), against the fp32 CPU reference; 16-bit modes take the tensor-core kernels where Hd
 * is a multiple of 16. The backward runs from the reference's out and lse. The gradients
 * are stored over NaNs on the GPU (the op overwrites: a value read back would stay NaN).
 * no_dk: dk is NULL (its NaNs must stay untouched, bit for bit). */
static void check_attention(moe_precision p, const char *mode, double bound, int B, int T, int H,
                            int Hd, int no_dk)
{
    const size_t n = (size_t)B * T * H * Hd, nl = (size_t)B * H * T;
    if (gpu->set_precision(p, NULL, 0, 0) != MOE_OK) {
        printf("FAIL %s: set_precision\n", mode);
        failures++;
        return;
    }
    float *h[6], *ref[5], *got = malloc(sizeof(float) * n), *pre = malloc(sizeof(float) * n);
    for (int a = 0; a < 6; a++) /* q, k, v, dout, out, lse */
        h[a] = malloc(sizeof(float) * n);
    for (int a = 0; a < 5; a++) /* out, lse, dq, dk, dv */
        ref[a] = calloc(n, sizeof(float));
    for (int a = 0; a < 4; a++)
        fill(h[a], n, 10 + a, 1.0);
    memset(pre, 0xff, sizeof(float) * n); /* NaNs */
    float *d[5], *g[3];
    for (int a = 0; a < 4; a++)
        d[a] = dev_copy(h[a], n);
    d[4] = gpu->alloc(sizeof(float) * n);
    float *dlse = gpu->alloc(sizeof(float) * nl);
    for (int a = 0; a < 3; a++)
        g[a] = dev_copy(pre, n);
    moe_backend_cpu.attention_forward(ref[0], ref[1], h[0], h[1], h[2], B, T, H, Hd);
    gpu->attention_forward(d[4], dlse, d[0], d[1], d[2], B, T, H, Hd);
    char what[64];
    to_host(h[4], d[4], n);
    to_host(h[5], dlse, nl);
    snprintf(what, sizeof what, "attention out T=%d Hd=%d", T, Hd);
    report(what, mode, rel_err(h[4], ref[0], n), bound);
    snprintf(what, sizeof what, "attention lse T=%d Hd=%d", T, Hd);
    report(what, mode, rel_err(h[5], ref[1], nl), bound);
    /* backward from the reference's forward, so only the backward is measured */
    float *dref_out = dev_copy(ref[0], n), *dref_lse = dev_copy(ref[1], nl);
    moe_backend_cpu.attention_backward(ref[2], no_dk ? NULL : ref[3], ref[4], h[3], ref[0], ref[1],
                                       h[0], h[1], h[2], B, T, H, Hd);
    gpu->attention_backward(g[0], no_dk ? NULL : g[1], g[2], d[3], dref_out, dref_lse, d[0], d[1],
                            d[2], B, T, H, Hd);
    /* With T = 1 the softmax has one key: dq and dk are 0 (the reference's exactly), and a
     * 16-bit dP - D leaves rounding noise; there the error is the RMS of the values,
     * relative to the size of the terms (scale |dout . v| |k|, about 1 for these inputs). */
    const char *names[3] = {"dq", "dk", "dv"};
    for (int a = 0; a < 3; a++) {
        to_host(got, g[a], n);
        double err = no_dk && a == 1 ? (memcmp(got, pre, sizeof(float) * n) != 0)
                                     : rel_err(got, ref[2 + a], n);
        if (T == 1 && a < 2)
            err /= sqrt((double)n);
        snprintf(what, sizeof what, "attention %s%s T=%d Hd=%d", names[a],
                 no_dk && a == 1   ? " (NULL)"
                 : T == 1 && a < 2 ? " (rms)"
                                   : "",
                 T, Hd);
        report(what, mode, err, no_dk && a == 1 ? 0.0 : bound);
    }
    if (gpu->sync() != MOE_OK) {
        printf("FAIL %s: the backend reported an error\n", mode);
        failures++;
    }
    for (int a = 0; a < 5; a++)
        gpu->release(d[a]);
    for (int a = 0; a < 3; a++)
        gpu->release(g[a]);
    gpu->release(dlse);
    gpu->release(dref_out);
    gpu->release(dref_lse);
    for (int a = 0; a < 6; a++)
        free(h[a]);
    for (int a = 0; a < 5; a++)
        free(ref[a]);
    free(got);
    free(pre);
}

/* q, k, v marked as 16-bit, as the model marks them where attention_operands16 says so
 * (the GEMMs write them in 16 bits, rope rotates them so): the attention forward and
 * backward must give the bits they give from fp32 buffers holding the same (widened)
 * values, which they round to those 16 bits themselves; rope_forward on a marked buffer
 * must store the rounding of the fp32 rotation of the widened values, bit for bit, and
 * rope_backward_qkv into a marked [dq | dk | dv] likewise (from marked or fp32 sources). */
static void check_attention_marked(moe_precision p, const char *mode, int B, int T, int H, int Hd)
{
    const size_t n = (size_t)B * T * H * Hd, nl = (size_t)B * H * T;
    if (p == MOE_PREC_FP32 || !gpu->attention_operands16(Hd))
        return;
    if (gpu->set_precision(p, NULL, 0, 0) != MOE_OK) {
        printf("FAIL %s: set_precision\n", mode);
        failures++;
        return;
    }
    uint16_t *b16 = malloc(sizeof(uint16_t) * n);
    float *hw = malloc(sizeof(float) * n), *got = malloc(sizeof(float) * n);
    float *d32[4], *d16[3], *o[2], *l[2], *g[2][3];
    for (int a = 0; a < 4; a++) { /* q, k, v, dout */
        fill(hw, n, 40 + a, 1.0);
        if (a < 3) { /* the 16-bit values, and the same widened into fp32 */
            for (size_t i = 0; i < n; i++) {
                b16[i] = p == MOE_PREC_BF16 ? moe_bf16_round(hw[i]) : moe_fp16_round(hw[i]);
                hw[i] = p == MOE_PREC_BF16 ? moe_bf16_widen(b16[i]) : moe_fp16_widen(b16[i]);
            }
            d16[a] = gpu->alloc(sizeof(float) * n);
            gpu->copy(d16[a], b16, sizeof(uint16_t) * n, MOE_COPY_H2D);
        }
        d32[a] = dev_copy(hw, n);
    }
    int st = 0;
    for (int a = 0; a < 3; a++)
        st += gpu->mark_operand(d16[a], n) != MOE_OK;
    for (int k = 0; k < 2; k++) {
        float *const *in = k ? d16 : d32;
        o[k] = gpu->alloc(sizeof(float) * n);
        l[k] = gpu->alloc(sizeof(float) * nl);
        gpu->attention_forward(o[k], l[k], in[0], in[1], in[2], B, T, H, Hd);
        for (int a = 0; a < 3; a++)
            g[k][a] = gpu->alloc(sizeof(float) * n);
        gpu->attention_backward(g[k][0], g[k][1], g[k][2], d32[3], o[0], l[0], in[0], in[1], in[2],
                                B, T, H, Hd);
    }
    char what[80];
    snprintf(what, sizeof what, "attention 16-bit q,k,v T=%d Hd=%d: same bits", T, Hd);
    report(what, mode,
           st + differ(o[0], o[1], n) + differ(l[0], l[1], nl) + differ(g[0][0], g[1][0], n) +
               differ(g[0][1], g[1][1], n) + differ(g[0][2], g[1][2], n),
           0.0);
    /* out, dout, dq, dk, dv marked too (as the model marks them): out holds the rounding of
     * the fp32 output, the lse is the same; the backward from 16-bit out and dout writes the
     * rounding of the fp32 gradients computed from fp32 copies of the same values */
    float *o16 = gpu->alloc(sizeof(float) * n), *l16 = gpu->alloc(sizeof(float) * nl);
    float *dout16 = gpu->alloc(sizeof(float) * n), *g16[3], *gr[3];
    fill(hw, n, 43, 1.0); /* dout's values, rounded */
    for (size_t i = 0; i < n; i++) {
        b16[i] = p == MOE_PREC_BF16 ? moe_bf16_round(hw[i]) : moe_fp16_round(hw[i]);
        hw[i] = p == MOE_PREC_BF16 ? moe_bf16_widen(b16[i]) : moe_fp16_widen(b16[i]);
    }
    gpu->copy(dout16, b16, sizeof(uint16_t) * n, MOE_COPY_H2D);
    float *dout_w = dev_copy(hw, n);
    int st16 = gpu->mark_operand(o16, n) != MOE_OK || gpu->mark_operand(dout16, n) != MOE_OK;
    for (int a = 0; a < 3; a++) {
        g16[a] = gpu->alloc(sizeof(float) * n);
        gr[a] = gpu->alloc(sizeof(float) * n);
        st16 += gpu->mark_operand(g16[a], n) != MOE_OK;
    }
    gpu->attention_forward(o16, l16, d16[0], d16[1], d16[2], B, T, H, Hd);
    read_marked(p, got, o16, n);
    float *out_w = dev_copy(got, n); /* the 16-bit output, widened */
    gpu->attention_backward(gr[0], gr[1], gr[2], dout_w, out_w, l[1], d16[0], d16[1], d16[2], B, T,
                            H, Hd);
    const long ds0 = moe_cuda_attention_dsum8();
    gpu->attention_backward(g16[0], g16[1], g16[2], dout16, o16, l[1], d16[0], d16[1], d16[2], B, T,
                            H, Hd);
    /* from the 16-bit dout and out, dsum's 8-value kernel (where Hd allows) against the
     * fp32 copies' (the scalar one): the rounded gradients below must have the same bits */
    const long ds8 = moe_cuda_attention_dsum8() - ds0, want8 = Hd % 8 == 0;
    snprintf(what, sizeof what, "attention dsum 8 values a load: %ld launches (want %ld)", ds8,
             want8);
    report(what, mode, (double)(ds8 != want8), 0.0);
    int bad16 = st16 + round16_mismatches(p, o[1], o16, n) + differ(l16, l[1], nl);
    snprintf(what, sizeof what, "attention 16-bit out T=%d Hd=%d: rounded fp32 out", T, Hd);
    report(what, mode, bad16, 0.0);
    bad16 = 0;
    for (int a = 0; a < 3; a++)
        bad16 += round16_mismatches(p, gr[a], g16[a], n);
    snprintf(what, sizeof what, "attention 16-bit dq,dk,dv T=%d Hd=%d: rounded fp32", T, Hd);
    report(what, mode, bad16, 0.0);
    /* attention_backward_qkv into a marked [dq | dk | dv] with marked scratch (the model's
     * buffers): the bits of rope_backward_qkv of the marked dq, dk, dv above; on an H200
     * (the wgmma kernels, Hd = 64) the kernels write it themselves, which must happen */
    {
        float *ct = gpu->alloc(sizeof(float) * (size_t)T * Hd), *sn = ct + (size_t)T * Hd / 2;
        gpu->rope_tables(ct, sn, T, Hd, 10000.0);
        float *qa = gpu->alloc(sizeof(float) * 3 * n), *qb = gpu->alloc(sizeof(float) * 3 * n);
        int badf = gpu->mark_operand(qa, 3 * n) != MOE_OK || gpu->mark_operand(qb, 3 * n) != MOE_OK;
        gpu->rope_backward_qkv(qb, g16[0], g16[1], g16[2], ct, sn, B, T, H, Hd);
        const long f0 = moe_cuda_attention_qkv_fused();
        gpu->attention_backward_qkv(qa, g16[0], g16[1], g16[2], dout16, o16, l[1], d16[0], d16[1],
                                    d16[2], ct, sn, B, T, H, Hd);
        const long fused = moe_cuda_attention_qkv_fused() - f0;
        uint16_t *ha = malloc(sizeof(uint16_t) * 3 * n), *hb = malloc(sizeof(uint16_t) * 3 * n);
        gpu->copy(ha, qa, sizeof(uint16_t) * 3 * n, MOE_COPY_D2H);
        gpu->copy(hb, qb, sizeof(uint16_t) * 3 * n, MOE_COPY_D2H);
        if (gpu->sync() != MOE_OK)
            badf++;
        for (size_t i = 0; i < 3 * n; i++)
            badf += ha[i] != hb[i];
        const char *env = getenv("MOE_ATTENTION_ROPE");
        const long expect =
            moe_cuda_attention_wgmma() && Hd == 64 && !(env && strcmp(env, "0") == 0);
        if (fused != expect) {
            printf("  attention_backward_qkv: %ld fused calls, expected %ld\n", fused, expect);
            badf++;
        }
        snprintf(what, sizeof what, "attention_backward_qkv 16-bit T=%d Hd=%d: %s", T, Hd,
                 expect ? "fused, same bits" : "same bits");
        report(what, mode, badf, 0.0);
        gpu->mark_operand(qa, 0);
        gpu->mark_operand(qb, 0);
        gpu->release(qa);
        gpu->release(qb);
        gpu->release(ct);
        free(ha);
        free(hb);
    }
    gpu->mark_operand(o16, 0);
    gpu->mark_operand(dout16, 0);
    for (int a = 0; a < 3; a++) {
        gpu->mark_operand(g16[a], 0);
        gpu->release(g16[a]);
        gpu->release(gr[a]);
    }
    gpu->release(o16);
    gpu->release(l16);
    gpu->release(dout16);
    gpu->release(dout_w);
    gpu->release(out_w);
    float *cs = gpu->alloc(sizeof(float) * (size_t)T * Hd), *sn = cs + (size_t)T * Hd / 2;
    gpu->rope_tables(cs, sn, T, Hd, 10000.0);
    /* [dq | dk | dv] (marked, as the model marks it) from marked dq, dk, dv and from fp32
     * ones (the T4's): the rounding of the fp32 op on fp32 copies of the same values */
    uint16_t *p16 = malloc(sizeof(uint16_t) * 3 * n);
    float *p32 = malloc(sizeof(float) * 3 * n);
    float *qkv32 = gpu->alloc(sizeof(float) * 3 * n), *qkv16 = gpu->alloc(sizeof(float) * 3 * n);
    int badq = gpu->mark_operand(qkv16, 3 * n) != MOE_OK;
    gpu->rope_backward_qkv(qkv32, d32[0], d32[1], d32[2], cs, sn, B, T, H, Hd);
    to_host(p32, qkv32, 3 * n);
    for (int k = 0; k < 2; k++) {
        float *const *in = k ? d32 : d16;
        gpu->rope_backward_qkv(qkv16, in[0], in[1], in[2], cs, sn, B, T, H, Hd);
        gpu->copy(p16, qkv16, sizeof(uint16_t) * 3 * n, MOE_COPY_D2H);
        if (gpu->sync() != MOE_OK)
            badq++;
        for (size_t i = 0; i < 3 * n; i++)
            badq +=
                p16[i] != (p == MOE_PREC_BF16 ? moe_bf16_round(p32[i]) : moe_fp16_round(p32[i]));
    }
    snprintf(what, sizeof what, "rope_backward_qkv 16-bit T=%d Hd=%d: rounded fp32", T, Hd);
    report(what, mode, badq, 0.0);
    gpu->mark_operand(qkv16, 0);
    gpu->release(qkv16);
    gpu->release(qkv32);
    free(p16);
    free(p32);
    /* rope on the marked q against the rounding of rope on the fp32 copy */
    gpu->rope_forward(d32[0], cs, sn, B, T, H, Hd);
    gpu->rope_forward(d16[0], cs, sn, B, T, H, Hd);
    to_host(got, d32[0], n);
    uint16_t *r16 = malloc(sizeof(uint16_t) * n);
    gpu->copy(r16, d16[0], sizeof(uint16_t) * n, MOE_COPY_D2H);
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += r16[i] != (p == MOE_PREC_BF16 ? moe_bf16_round(got[i]) : moe_fp16_round(got[i]));
    snprintf(what, sizeof what, "rope 16-bit T=%d Hd=%d: rounded fp32 rotation", T, Hd);
    report(what, mode, bad, 0.0);
    if (gpu->sync() != MOE_OK) {
        printf("FAIL %s: the backend reported an error\n", mode);
        failures++;
    }
    for (int a = 0; a < 3; a++) {
        gpu->mark_operand(d16[a], 0);
        gpu->release(d16[a]);
    }
    for (int a = 0; a < 4; a++)
        gpu->release(d32[a]);
    for (int k = 0; k < 2; k++) {
        gpu->release(o[k]);
        gpu->release(l[k]);
        for (int a = 0; a < 3; a++)
            gpu->release(g[k][a]);
    }
    gpu->release(cs);
    free(b16);
    free(hw);
    free(got);
    free(r16);
}

/* The attention shapes of one precision: a tail tile (T = 200), one token, Hd = 128, a
 * padded head dim (Hd = 32) with dk NULL, Hd = 40 (not a multiple of 16: fp32 kernels in
 * every mode), and T = 700. */
static void check_attention_mode(moe_precision p, const char *mode, double bound)
{
    check_attention(p, mode, bound, 2, 200, 3, 64, 0);
    check_attention(p, mode, bound, 2, 1, 3, 64, 0);
    check_attention(p, mode, bound, 2, 200, 3, 128, 0);
    check_attention(p, mode, bound, 1, 77, 2, 32, 1);
    check_attention(p, mode, bound, 1, 70, 2, 40, 0);
    check_attention(p, mode, bound, 1, 700, 2, 64, 0); /* 11 tiles: long causal walks */
    check_attention_marked(p, mode, 2, 200, 3, 64);
    check_attention_marked(p, mode, 1, 77, 2, 32);
    check_attention_marked(p, mode, 2, 200, 3, 128);
}

/* The kernel profile counts a bracket opened inside another in the outermost: a grouped
 * GEMM whose problems run one by one over several streams (fp16: cuBLAS refuses its
 * grouped call) is one piece, "cuBLASLt GEMMs on several streams", and none of its
 * GEMMs a piece of its own (their events on the backend's stream would time nothing of
 * theirs). Needs the default lanes (MOE_GEMM_STREAMS unset); on cuBLAS (sm_90 would take
 * the wgmma kernel). */
static void check_profile_nesting(void)
{
    enum { G = 6, R = 40, I = 64, O = 48 };
    int offsets[G + 1];
    for (int g = 0; g <= G; g++)
        offsets[g] = g * R;
    float *hx = malloc(sizeof(float) * G * R * I), *hw = malloc(sizeof(float) * G * O * I);
    fill(hx, (size_t)G * R * I, 21, 1.0);
    fill(hw, (size_t)G * O * I, 22, 0.1);
    float *x = dev_copy(hx, (size_t)G * R * I), *w = dev_copy(hw, (size_t)G * O * I);
    float *out = gpu->alloc(sizeof(float) * G * R * O);
    setenv("MOE_GROUPED_GEMM", "cublas", 1);
    gpu->set_precision(MOE_PREC_FP16, w, (size_t)G * O * I, (size_t)G * R * I);
    gpu->refresh_shadow();
    gpu->grouped_matmul_forward(out, x, w, offsets, G, I, O); /* cuBLAS's refusal, once */
    gpu->profile(1, NULL);
    gpu->grouped_matmul_forward(out, x, w, offsets, G, I, O);
    FILE *f = tmpfile();
    long lanes_calls = -1, gemm_lines = 0;
    if (f) {
        gpu->profile(0, f);
        rewind(f);
        char line[256];
        while (fgets(line, sizeof line, f)) {
            const char *name = "cuBLASLt GEMMs on several streams";
            if (strstr(line, name))
                sscanf(strstr(line, name) + strlen(name), "%ld", &lanes_calls);
            gemm_lines += strstr(line, "cublasLt GEMM ") != NULL;
        }
        fclose(f);
    }
    printf("  profile of one grouped call over several streams: %ld piece(s) for the call, %ld "
           "line(s) of single GEMMs\n",
           lanes_calls, gemm_lines);
    report("profile: nested brackets", "fp16", lanes_calls == 1 && gemm_lines == 0 ? 0.0 : 1.0,
           0.0);
    unsetenv("MOE_GROUPED_GEMM");
    gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0);
    gpu->release(x);
    gpu->release(w);
    gpu->release(out);
    free(hx);
    free(hw);
}

int main(void)
{
    const char *why = NULL;
    gpu = moe_backend_cuda(&why);
    if (!gpu) {
        printf("SKIP: no usable GPU: %s\n", why);
        return 77;
    }
    int cc = gpu->compute_capability();
    cc_main = cc;
    printf("GPU sm_%d\n", cc);
    check_mode(MOE_PREC_FP32, "fp32", 1e-5);
    check_mode(MOE_PREC_FP16, "fp16", 5e-3);
    check_attention_mode(MOE_PREC_FP32, "fp32", 1e-5);
    check_attention_mode(MOE_PREC_FP16, "fp16", 5e-3);
    if (cc >= 80) {
        check_mode(MOE_PREC_BF16, "bf16", 1e-2);
        check_attention_mode(MOE_PREC_BF16, "bf16", 1e-2);
        check_grads16();
        if (cc >= 90) { /* that on the wgmma kernel: again on cuBLAS */
            setenv("MOE_GROUPED_GEMM", "cublas", 1);
            check_grads16();
            unsetenv("MOE_GROUPED_GEMM");
        }
        check_grouped_large(MOE_PREC_FP16, "fp16", 5e-3);
        check_grouped_large(MOE_PREC_BF16, "bf16", 1e-2);
        /* the mma.sync kernels of sm_80, which sm_90 replaces by wgmma at head dim 64 */
        if (cc >= 90) {
            /* the experts' GEMMs on the wgmma grouped kernel (sm_90's default; the checks
             * above ran on it) with its knobs (NULL: unset): MOE_GROUPED_GEMM=cublas, which
             * must launch none of it (cuBLAS's grouped path, the default of other GPUs);
             * 3 blocks a launch, each walking many tiles and problems; 16-bit outputs
             * stored from registers (MOE_GROUPED_WGMMA_TMASTORE=0) rather than staged in
             * shared memory and stored by TMA (an added-to output always from registers;
             * groups of 130 and 679 rows end in tiles of 2 and 39 rows); some layouts on
             * the kernel and the others on cuBLAS beside it */
            static const struct {
                const char *path, *blocks, *tma_store, *classes;
                int large; /* check_grouped_large, else check_mode */
                moe_precision p;
                const char *mode;
            } gw[] = {
                {"cublas", NULL, NULL, NULL, 0, MOE_PREC_FP16, "fp16 cublas"},
                {"cublas", NULL, NULL, NULL, 0, MOE_PREC_BF16, "bf16 cublas"},
                {"cublas", NULL, NULL, NULL, 1, MOE_PREC_FP16, "fp16 cublas"},
                {"cublas", NULL, NULL, NULL, 1, MOE_PREC_BF16, "bf16 cublas"},
                {NULL, NULL, "0", NULL, 0, MOE_PREC_FP16, "fp16 gw regs"},
                {NULL, NULL, "0", NULL, 0, MOE_PREC_BF16, "bf16 gw regs"},
                {NULL, NULL, "0", NULL, 1, MOE_PREC_FP16, "fp16 gw regs"},
                {NULL, NULL, "0", NULL, 1, MOE_PREC_BF16, "bf16 gw regs"},
                {NULL, "3", "0", NULL, 1, MOE_PREC_BF16, "bf16 gw regs3"},
                {NULL, "3", "0", NULL, 0, MOE_PREC_BF16, "bf16 gw regs3"},
                {NULL, NULL, NULL, NULL, 1, MOE_PREC_BF16, "bf16 gw"},
                {NULL, "3", NULL, NULL, 1, MOE_PREC_FP16, "fp16 gw3"},
                {NULL, NULL, NULL, "1", 1, MOE_PREC_BF16, "bf16 gw fwd"},
                {NULL, NULL, NULL, "1", 0, MOE_PREC_FP16, "fp16 gw fwd"},
                {NULL, NULL, NULL, "6", 1, MOE_PREC_FP16, "fp16 gw bwd"},
                {NULL, NULL, NULL, "6", 0, MOE_PREC_BF16, "bf16 gw bwd"},
                {NULL, NULL, NULL, "2", 1, MOE_PREC_BF16, "bf16 gw dx"},
            };
            const char *knob[4] = {"MOE_GROUPED_GEMM", "MOE_GROUPED_WGMMA_BLOCKS",
                                   "MOE_GROUPED_WGMMA_TMASTORE", "MOE_GROUPED_WGMMA_CLASSES"};
            long wg = 0, wg_cublas = 0;
            for (size_t r = 0; r < sizeof gw / sizeof gw[0]; r++) {
                const char *value[4] = {gw[r].path, gw[r].blocks, gw[r].tma_store, gw[r].classes};
                for (int k = 0; k < 4; k++)
                    if (value[k])
                        setenv(knob[k], value[k], 1);
                    else
                        unsetenv(knob[k]);
                const double bound = gw[r].p == MOE_PREC_FP16 ? 5e-3 : 1e-2;
                const long wg0 = moe_cuda_grouped_wgmma_launches();
                if (gw[r].large)
                    check_grouped_large(gw[r].p, gw[r].mode, bound);
                else
                    check_mode(gw[r].p, gw[r].mode, bound);
                *(gw[r].path ? &wg_cublas : &wg) += moe_cuda_grouped_wgmma_launches() - wg0;
            }
            for (int k = 0; k < 4; k++)
                unsetenv(knob[k]);
            printf("  wgmma grouped GEMM: %ld launches (%ld under MOE_GROUPED_GEMM=cublas)\n", wg,
                   wg_cublas);
            report("wgmma grouped kernel ran", "16", wg > 0 ? 0.0 : 1.0, 0.0);
            report("MOE_GROUPED_GEMM=cublas: no wgmma", "16", wg_cublas == 0 ? 0.0 : 1.0, 0.0);
            /* the wgmma kernels' other block shapes (1 warpgroup for the forward, 2 for
             * dq and dk/dv) */
            setenv("MOE_ATTENTION_WG", "1", 1);
            setenv("MOE_ATTENTION_DQ_WG", "2", 1);
            setenv("MOE_ATTENTION_DKV_WG", "2", 1);
            check_attention_mode(MOE_PREC_FP16, "fp16 wg", 5e-3);
            check_attention_mode(MOE_PREC_BF16, "bf16 wg", 1e-2);
            unsetenv("MOE_ATTENTION_WG");
            unsetenv("MOE_ATTENTION_DQ_WG");
            unsetenv("MOE_ATTENTION_DKV_WG");
            /* dk/dv's walk over 3 buffers */
            setenv("MOE_ATTENTION_DKV_STAGES", "3", 1);
            check_attention_mode(MOE_PREC_FP16, "fp16 dkv3", 5e-3);
            check_attention_mode(MOE_PREC_BF16, "bf16 dkv3", 1e-2);
            unsetenv("MOE_ATTENTION_DKV_STAGES");
            setenv("MOE_ATTENTION", "mma", 1);
            check_attention_mode(MOE_PREC_FP16, "fp16 mma", 5e-3);
            check_attention_mode(MOE_PREC_BF16, "bf16 mma", 1e-2);
            unsetenv("MOE_ATTENTION");
        }
        /* the wmma kernels of sm_75, which sm_80 and later replace by mma.sync */
        setenv("MOE_ATTENTION", "wmma", 1);
        check_attention_mode(MOE_PREC_FP16, "fp16 wmma", 5e-3);
        check_attention_mode(MOE_PREC_BF16, "bf16 wmma", 1e-2);
        unsetenv("MOE_ATTENTION");
    } else {
        moe_status st = gpu->set_precision(MOE_PREC_BF16, NULL, 0, 0);
        report("bf16 refused below sm_80", "bf16", st == MOE_ERR_INVALID ? 0.0 : 1.0, 0.0);
    }
    gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0);
    if (!getenv("MOE_GEMM_STREAMS"))
        check_profile_nesting();
    printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
