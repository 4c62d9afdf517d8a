/* tests/unit/test_ops_f64.c: finite-difference checks of every backward in kernels/ops.h,
 * in double precision (this file links moe_core_f64, where real = double).
 *
 * Each check builds a scalar L = sum(R * f(inputs)) with a random projection R, takes the
 * analytic gradient from the backward, and compares it with central differences
 * (eps 1e-6): |a - fd| <= 1e-7 + 1e-6 |fd|, printing the first mismatches. Gradient
 * buffers start at random nonzero values and the check compares what the backward ADDED
 * (after - start), so a backward that overwrites instead of accumulating fails; the one
 * op that overwrites (cross_entropy_backward) is compared as written, so accumulating
 * fails there. Inputs are random and never zero. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "util/rng.h"

_Static_assert(sizeof(real) == sizeof(double), "the FD tests need the double core");

#define FD_EPS 1e-6
#define ATOL 1e-7
#define RTOL 1e-6
#define MAX_PRINT 6

/* ---- buffers: a small pool per test, freed at its end ---------------------------- */

typedef struct {
    void *p[64];
    int n;
} pool;

static void *pool_alloc(pool *pl, size_t nbytes)
{
    assert_true(pl->n < 64);
    void *p = calloc(1, nbytes ? nbytes : 1);
    assert_non_null(p);
    pl->p[pl->n++] = p;
    return p;
}

static void pool_free(pool *pl)
{
    for (int i = 0; i < pl->n; i++)
        free(pl->p[i]);
    pl->n = 0;
}

static uint64_t rng_index;

/* Uniform in +-[lo, hi]: random sign, magnitude at least lo > 0 (never zero). */
static double rnd(double lo, double hi)
{
    double u = moe_rng_uniform(42, 1, rng_index++);
    double s = moe_rng_uniform(42, 2, rng_index++) < 0.5 ? -1.0 : 1.0;
    return s * (lo + (hi - lo) * u);
}

static real *buf_rand(pool *pl, size_t n, double lo, double hi)
{
    real *x = pool_alloc(pl, n * sizeof(real));
    for (size_t i = 0; i < n; i++)
        x[i] = rnd(lo, hi);
    return x;
}

static real *buf_copy(pool *pl, const real *x, size_t n)
{
    real *y = pool_alloc(pl, n * sizeof(real));
    memcpy(y, x, n * sizeof(real));
    return y;
}

static real *buf_zero(pool *pl, size_t n) { return pool_alloc(pl, n * sizeof(real)); }

static double dot(const real *a, const real *b, size_t n)
{
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* d = after - start: what a backward added. */
static real *added(pool *pl, const real *after, const real *start, size_t n)
{
    real *d = buf_zero(pl, n);
    for (size_t i = 0; i < n; i++)
        d[i] = after[i] - start[i];
    return d;
}

/* ---- the finite-difference comparison --------------------------------------------- */

typedef double (*objective)(void *ctx);

/* Compares grad (n, printed as rows of `cols`) with central differences of f w.r.t. the
 * n values at x, perturbed in place and restored. Returns 1 when all match. */
static int check_fd(const char *what, real *x, const real *grad, size_t n, int cols, objective f,
                    void *ctx)
{
    int bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < n; i++) {
        real save = x[i];
        x[i] = save + FD_EPS;
        double lp = f(ctx);
        x[i] = save - FD_EPS;
        double lm = f(ctx);
        x[i] = save;
        double fd = (lp - lm) / (2.0 * FD_EPS);
        double err = fabs(grad[i] - fd);
        if (err > worst)
            worst = err;
        if (!(err <= ATOL + RTOL * fabs(fd))) {
            if (bad < MAX_PRINT)
                fprintf(stderr, "  %s[%zu,%zu]: analytic %.10g, fd %.10g, diff %.3g\n", what,
                        i / (size_t)cols, i % (size_t)cols, grad[i], fd, err);
            bad++;
        }
    }
    if (bad)
        fprintf(stderr, "  %s: %d of %zu mismatch (worst %.3g)\n", what, bad, n, worst);
    return bad == 0;
}

/* ---- embedding -------------------------------------------------------------------- */

typedef struct {
    real *out, *table, *R;
    const int32_t *tokens;
    int N, D;
} emb_ctx;

static double emb_loss(void *c)
{
    emb_ctx *e = c;
    embedding_forward(e->out, e->tokens, e->table, e->N, e->D);
    return dot(e->R, e->out, (size_t)e->N * e->D);
}

static void test_embedding_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { N = 6, D = 3, V = 4 };
    static const int32_t tokens[N] = {1, 3, 1, 0, 2, 1};
    emb_ctx e = {buf_zero(&pl, N * D),
                 buf_rand(&pl, V * D, 0.1, 1),
                 buf_rand(&pl, N * D, 0.1, 1),
                 tokens,
                 N,
                 D};
    real *g0 = buf_rand(&pl, V * D, 0.1, 1), *g = buf_copy(&pl, g0, V * D);
    embedding_backward(g, e.R, tokens, N, D, V);
    assert_true(check_fd("dtable", e.table, added(&pl, g, g0, V * D), V * D, D, emb_loss, &e));
    pool_free(&pl);
}

/* ---- rmsnorm -------------------------------------------------------------------- */

typedef struct {
    real *out, *rstd, *x, *w, *R;
    int N, D;
} rms_ctx;

static double rms_loss(void *c)
{
    rms_ctx *r = c;
    rmsnorm_forward(r->out, r->rstd, r->x, r->w, r->N, r->D, 1e-5);
    return dot(r->R, r->out, (size_t)r->N * r->D);
}

static void test_rmsnorm_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { N = 3, D = 70 }; /* D > 64: two column blocks of dweight */
    rms_ctx r = {buf_zero(&pl, N * D),
                 buf_zero(&pl, N),
                 buf_rand(&pl, N * D, 0.1, 2),
                 buf_rand(&pl, D, 0.5, 1.5),
                 buf_rand(&pl, N * D, 0.1, 1),
                 N,
                 D};
    rms_loss(&r); /* rstd */
    real *dx0 = buf_rand(&pl, N * D, 0.1, 1), *dx = buf_copy(&pl, dx0, N * D);
    real *dw0 = buf_rand(&pl, D, 0.1, 1), *dw = buf_copy(&pl, dw0, D);
    rmsnorm_backward(dx, dw, r.R, r.x, r.w, r.rstd, N, D, 0, NULL);
    assert_true(check_fd("dx", r.x, added(&pl, dx, dx0, N * D), N * D, D, rms_loss, &r));
    assert_true(check_fd("dweight", r.w, added(&pl, dw, dw0, D), D, D, rms_loss, &r));

    /* NULL gradients: the other one comes out the same. */
    rms_loss(&r); /* rstd of the unperturbed inputs again */
    real *dxb = buf_copy(&pl, dx0, N * D), *dwb = buf_copy(&pl, dw0, D);
    rmsnorm_backward(dxb, NULL, r.R, r.x, r.w, r.rstd, N, D, 0, NULL);
    rmsnorm_backward(NULL, dwb, r.R, r.x, r.w, r.rstd, N, D, 0, NULL);
    assert_memory_equal(dxb, dx, N * D * sizeof(real));
    assert_memory_equal(dwb, dw, D * sizeof(real));

    /* written (over other values) as added to zeros, each flag alone and both */
    real *dxz = buf_zero(&pl, N * D), *dwz = buf_zero(&pl, D);
    rmsnorm_backward(dxz, dwz, r.R, r.x, r.w, r.rstd, N, D, 0, NULL);
    for (int write = 1; write <= 3; write++) {
        real *dxw = buf_copy(&pl, dx0, N * D), *dww = buf_copy(&pl, dw0, D);
        rmsnorm_backward(dxw, dww, r.R, r.x, r.w, r.rstd, N, D, write, NULL);
        assert_memory_equal(dxw, write & MOE_WRITE_DX ? dxz : dx, N * D * sizeof(real));
        assert_memory_equal(dww, write & MOE_WRITE_DW ? dwz : dw, D * sizeof(real));
    }

    /* dx_op: a copy of dx's final values (the cpu holds no 16-bit operands) */
    real *dxo = buf_copy(&pl, dx0, N * D), *op = buf_rand(&pl, N * D, 0.1, 1);
    rmsnorm_backward(dxo, NULL, r.R, r.x, r.w, r.rstd, N, D, 0, op);
    assert_memory_equal(dxo, dx, N * D * sizeof(real));
    assert_memory_equal(op, dx, N * D * sizeof(real));
    pool_free(&pl);
}

/* ---- matmul and grouped matmul ---------------------------------------------------- */

typedef struct {
    real *out, *x, *w, *R;
    const int *offsets; /* NULL: plain matmul */
    int N, I, O, G;
} mm_ctx;

static double mm_loss(void *c)
{
    mm_ctx *m = c;
    if (m->offsets)
        grouped_matmul_forward(m->out, m->x, m->w, m->offsets, m->G, m->I, m->O);
    else
        matmul_forward(m->out, m->x, m->w, m->N, m->I, m->O);
    return dot(m->R, m->out, (size_t)m->N * m->O);
}

static void check_matmul(int N, int I, int O)
{
    pool pl = {0};
    size_t nx = (size_t)N * I, nw = (size_t)O * I, no = (size_t)N * O;
    mm_ctx m = {buf_zero(&pl, no),
                buf_rand(&pl, nx, 0.1, 1),
                buf_rand(&pl, nw, 0.1, 1),
                buf_rand(&pl, no, 0.1, 1),
                NULL,
                N,
                I,
                O,
                1};
    real *dx0 = buf_rand(&pl, nx, 0.1, 1), *dx = buf_copy(&pl, dx0, nx);
    real *dw0 = buf_rand(&pl, nw, 0.1, 1), *dw = buf_copy(&pl, dw0, nw);
    matmul_backward(dx, dw, m.R, m.x, m.w, N, I, O, 0);
    assert_true(check_fd("dx", m.x, added(&pl, dx, dx0, nx), nx, I, mm_loss, &m));
    assert_true(check_fd("dw", m.w, added(&pl, dw, dw0, nw), nw, I, mm_loss, &m));

    real *dxb = buf_copy(&pl, dx0, nx), *dwb = buf_copy(&pl, dw0, nw);
    matmul_backward(dxb, NULL, m.R, m.x, m.w, N, I, O, 0);
    matmul_backward(NULL, dwb, m.R, m.x, m.w, N, I, O, 0);
    assert_memory_equal(dxb, dx, nx * sizeof(real));
    assert_memory_equal(dwb, dw, nw * sizeof(real));

    /* written (MOE_WRITE_DX, MOE_WRITE_DW): the random contents before are gone */
    real *dxw = buf_copy(&pl, dx0, nx), *dww = buf_copy(&pl, dw0, nw);
    matmul_backward(dxw, dww, m.R, m.x, m.w, N, I, O, MOE_WRITE_DX | MOE_WRITE_DW);
    assert_true(check_fd("dx written", m.x, dxw, nx, I, mm_loss, &m));
    assert_true(check_fd("dw written", m.w, dww, nw, I, mm_loss, &m));
    pool_free(&pl);
}

static void test_matmul_backward(void **state)
{
    (void)state;
    check_matmul(3, 5, 4);
    check_matmul(4, 37, 3); /* two full lanes of the dot product and a tail */
}

static void test_grouped_matmul_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { G = 4, M = 7, I = 5, O = 4 };
    static const int offsets[G + 1] = {0, 3, 3, 4, 7}; /* group 1 empty, group 2 one row */
    size_t nx = M * I, nw = G * O * I, no = M * O;
    mm_ctx m = {buf_zero(&pl, no),
                buf_rand(&pl, nx, 0.1, 1),
                buf_rand(&pl, nw, 0.1, 1),
                buf_rand(&pl, no, 0.1, 1),
                offsets,
                M,
                I,
                O,
                G};
    real *dx0 = buf_rand(&pl, nx, 0.1, 1), *dx = buf_copy(&pl, dx0, nx);
    real *dw0 = buf_rand(&pl, nw, 0.1, 1), *dw = buf_copy(&pl, dw0, nw);
    grouped_matmul_backward(dx, dw, m.R, m.x, m.w, offsets, G, I, O, 0);
    assert_true(check_fd("dx", m.x, added(&pl, dx, dx0, nx), nx, I, mm_loss, &m));
    assert_true(check_fd("dw", m.w, added(&pl, dw, dw0, nw), nw, I, mm_loss, &m));
    /* the empty group's weight gradient is untouched, bit for bit */
    assert_memory_equal(dw + O * I, dw0 + O * I, O * I * sizeof(real));
    /* written: dx and dw whatever they held (the sums from zero), the empty group zeroed */
    real *dwz = buf_zero(&pl, nw), *dwf = buf_rand(&pl, nw, 0.1, 1);
    real *dxz = buf_zero(&pl, nx), *dxf = buf_rand(&pl, nx, 0.1, 1);
    grouped_matmul_backward(dxz, dwz, m.R, m.x, m.w, offsets, G, I, O, 0);
    grouped_matmul_backward(dxf, dwf, m.R, m.x, m.w, offsets, G, I, O, MOE_WRITE_DW | MOE_WRITE_DX);
    assert_memory_equal(dwf, dwz, nw * sizeof(real));
    assert_memory_equal(dxf, dxz, nx * sizeof(real));
    for (int i = 0; i < O * I; i++)
        assert_true(dwf[O * I + i] == 0);
    pool_free(&pl);
}

/* ---- swiglu --------------------------------------------------------------------- */

typedef struct {
    real *h, *a, *b, *R;
    size_t n;
} swi_ctx;

static double swi_loss(void *c)
{
    swi_ctx *s = c;
    swiglu_forward(s->h, s->a, s->b, s->n);
    return dot(s->R, s->h, s->n);
}

static void test_swiglu_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { n = 12 };
    swi_ctx s = {buf_zero(&pl, n), buf_rand(&pl, n, 0.1, 4), buf_rand(&pl, n, 0.1, 2),
                 buf_rand(&pl, n, 0.1, 1), n};
    /* random contents before: swiglu_backward overwrites them */
    real *da = buf_rand(&pl, n, 0.1, 1), *db = buf_rand(&pl, n, 0.1, 1);
    swiglu_backward(da, db, s.R, s.a, s.b, n);
    assert_true(check_fd("da", s.a, da, n, n, swi_loss, &s));
    assert_true(check_fd("db", s.b, db, n, n, swi_loss, &s));
    pool_free(&pl);
}

/* ---- rope ----------------------------------------------------------------------- */

typedef struct {
    real *y, *x, *R, *cos_t, *sin_t;
    int B, T, H, Hd;
} rope_ctx;

static double rope_loss(void *c)
{
    rope_ctx *r = c;
    size_t n = (size_t)r->B * r->T * r->H * r->Hd;
    memcpy(r->y, r->x, n * sizeof(real));
    rope_forward(r->y, r->cos_t, r->sin_t, r->B, r->T, r->H, r->Hd);
    return dot(r->R, r->y, n);
}

/* rope_backward is in place by contract (the gradient of the output becomes the gradient
 * of the input), so there is no += to check here. */
static void test_rope_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { B = 2, T = 4, H = 2, Hd = 6 };
    size_t n = B * T * H * Hd;
    rope_ctx r = {buf_zero(&pl, n),
                  buf_rand(&pl, n, 0.1, 1),
                  buf_rand(&pl, n, 0.1, 1),
                  buf_zero(&pl, T * Hd / 2),
                  buf_zero(&pl, T * Hd / 2),
                  B,
                  T,
                  H,
                  Hd};
    rope_tables(r.cos_t, r.sin_t, T, Hd, 10.0);
    real *g = buf_copy(&pl, r.R, n);
    rope_backward(g, r.cos_t, r.sin_t, B, T, H, Hd);
    assert_true(check_fd("dx", r.x, g, n, H * Hd, rope_loss, &r));
    pool_free(&pl);
}

/* ---- attention ------------------------------------------------------------------ */

typedef struct {
    real *out, *lse, *q, *k, *v, *R;
    int B, T, H, Hd;
} att_ctx;

static double att_loss(void *c)
{
    att_ctx *a = c;
    attention_forward(a->out, a->lse, a->q, a->k, a->v, a->B, a->T, a->H, a->Hd);
    return dot(a->R, a->out, (size_t)a->B * a->T * a->H * a->Hd);
}

static void test_attention_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { B = 2, T = 5, H = 2, Hd = 4 };
    size_t n = B * T * H * Hd;
    att_ctx a = {buf_zero(&pl, n),
                 buf_zero(&pl, B * H * T),
                 buf_rand(&pl, n, 0.1, 1.5),
                 buf_rand(&pl, n, 0.1, 1.5),
                 buf_rand(&pl, n, 0.1, 1),
                 buf_rand(&pl, n, 0.1, 1),
                 B,
                 T,
                 H,
                 Hd};
    att_loss(&a); /* out, lse */
    real *dq0 = buf_rand(&pl, n, 0.1, 1), *dq = buf_copy(&pl, dq0, n);
    real *dk0 = buf_rand(&pl, n, 0.1, 1), *dk = buf_copy(&pl, dk0, n);
    real *dv0 = buf_rand(&pl, n, 0.1, 1), *dv = buf_copy(&pl, dv0, n);
    /* the gradients overwrite what dq, dk, dv held (random values) */
    attention_backward(dq, dk, dv, a.R, a.out, a.lse, a.q, a.k, a.v, B, T, H, Hd);
    assert_true(check_fd("dq", a.q, dq, n, H * Hd, att_loss, &a));
    assert_true(check_fd("dk", a.k, dk, n, H * Hd, att_loss, &a));
    assert_true(check_fd("dv", a.v, dv, n, H * Hd, att_loss, &a));

    /* each gradient alone (the others NULL) comes out the same */
    att_loss(&a); /* out, lse of the unperturbed inputs again */
    real *dqb = buf_copy(&pl, dq0, n), *dkb = buf_copy(&pl, dk0, n), *dvb = buf_copy(&pl, dv0, n);
    attention_backward(dqb, NULL, NULL, a.R, a.out, a.lse, a.q, a.k, a.v, B, T, H, Hd);
    attention_backward(NULL, dkb, NULL, a.R, a.out, a.lse, a.q, a.k, a.v, B, T, H, Hd);
    attention_backward(NULL, NULL, dvb, a.R, a.out, a.lse, a.q, a.k, a.v, B, T, H, Hd);
    assert_memory_equal(dqb, dq, n * sizeof(real));
    assert_memory_equal(dkb, dk, n * sizeof(real));
    assert_memory_equal(dvb, dv, n * sizeof(real));
    pool_free(&pl);
}

/* ---- router: softmax, top-k ------------------------------------------------------- */

typedef struct {
    real *probs, *lse, *w, *logits, *R;
    int32_t *idx, *idx_ref;     /* idx_ref: the base top-k; FD must not change it */
    int N, E, K, renorm, wrt_w; /* wrt_w: L = R.w, else L = R.probs */
    int topk_changed;
} rt_ctx;

static double rt_loss(void *c)
{
    rt_ctx *r = c;
    router_forward(r->probs, r->lse, r->idx, r->w, NULL, r->logits, r->N, r->E, r->K, r->renorm);
    if (r->idx_ref && memcmp(r->idx, r->idx_ref, (size_t)r->N * r->K * sizeof(int32_t)) != 0)
        r->topk_changed = 1;
    if (r->wrt_w)
        return dot(r->R, r->w, (size_t)r->N * r->K);
    return dot(r->R, r->probs, (size_t)r->N * r->E);
}

static void test_softmax_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { N = 4, E = 6, K = 2 };
    rt_ctx r = {buf_zero(&pl, N * E),
                buf_zero(&pl, N),
                buf_zero(&pl, N * K),
                buf_rand(&pl, N * E, 0.1, 2),
                buf_rand(&pl, N * E, 0.1, 1),
                pool_alloc(&pl, N * K * sizeof(int32_t)),
                NULL,
                N,
                E,
                K,
                0,
                0,
                0};
    rt_loss(&r);
    real *dl0 = buf_rand(&pl, N * E, 0.1, 1), *dl = buf_copy(&pl, dl0, N * E);
    softmax_backward(dl, r.R, r.probs, N, E);
    assert_true(check_fd("dlogits", r.logits, added(&pl, dl, dl0, N * E), N * E, E, rt_loss, &r));
    pool_free(&pl);
}

/* L = R . w(logits): router_topk_backward into dprobs, then softmax_backward. */
static void check_router_topk(int renorm)
{
    pool pl = {0};
    enum { N = 4, E = 6, K = 2 };
    rt_ctx r = {buf_zero(&pl, N * E),
                buf_zero(&pl, N),
                buf_zero(&pl, N * K),
                buf_rand(&pl, N * E, 0.1, 2),
                buf_rand(&pl, N * K, 0.1, 1),
                pool_alloc(&pl, N * K * sizeof(int32_t)),
                pool_alloc(&pl, N * K * sizeof(int32_t)),
                N,
                E,
                K,
                renorm,
                1,
                0};
    int32_t *ref = r.idx_ref;
    r.idx_ref = NULL;
    rt_loss(&r);
    memcpy(ref, r.idx, N * K * sizeof(int32_t));
    r.idx_ref = ref;

    real *dp0 = buf_rand(&pl, N * E, 0.1, 1), *dp = buf_copy(&pl, dp0, N * E);
    router_topk_backward(dp, r.R, r.probs, r.idx, N, E, K, renorm);
    real *gp = added(&pl, dp, dp0, N * E);
    for (int n = 0; n < N; n++) /* experts outside the top-k get nothing */
        for (int e = 0; e < E; e++) {
            int chosen = 0;
            for (int k = 0; k < K; k++)
                chosen |= r.idx[n * K + k] == e;
            if (!chosen)
                assert_true(gp[n * E + e] == 0.0);
        }
    real *dl0 = buf_rand(&pl, N * E, 0.1, 1), *dl = buf_copy(&pl, dl0, N * E);
    softmax_backward(dl, gp, r.probs, N, E);
    assert_true(check_fd(renorm ? "dlogits(renorm)" : "dlogits", r.logits,
                         added(&pl, dl, dl0, N * E), N * E, E, rt_loss, &r));
    assert_false(r.topk_changed);
    pool_free(&pl);
}

static void test_router_topk_backward(void **state)
{
    (void)state;
    check_router_topk(0);
    check_router_topk(1);
}

/* ---- router auxiliary losses ------------------------------------------------------ */

/* This rank's N tokens plus fixed partials from "another rank" of N_OTHER tokens, so the
 * global count Ng differs from N. */
enum { AUX_N = 8, AUX_E = 4, AUX_K = 2, AUX_N_OTHER = 5 };
static const int64_t aux_other_counts[AUX_E] = {3, 2, 4, 1};
static const double aux_other_psum[AUX_E] = {1.5, 1.0, 1.75, 0.75};
static const double aux_other_lse2 = 7.25;
static const double coef_aux = 0.7, coef_z = 0.3;

typedef struct {
    real *probs, *lse, *w, *logits;
    int32_t *idx, *idx_ref;
    int from_logits; /* 1: probs, lse, idx from router_forward(logits); 0: as given */
    int topk_changed;
} aux_ctx;

/* The partial sums from probs, lse and idx as given (the loss w.r.t. probs holds the
 * router's outputs fixed): counts +=, psum +=, returns the sum of lse^2. */
static double given_partials(int64_t *counts, double *psum, const aux_ctx *a)
{
    double lse2 = 0.0;
    for (int n = 0; n < AUX_N; n++) {
        for (int k = 0; k < AUX_K; k++)
            counts[a->idx[n * AUX_K + k]]++;
        for (int e = 0; e < AUX_E; e++)
            psum[e] += a->probs[n * AUX_E + e];
        lse2 += (double)a->lse[n] * a->lse[n];
    }
    return lse2;
}

static double aux_loss(void *c)
{
    aux_ctx *a = c;
    enum { N = AUX_N, E = AUX_E, K = AUX_K };
    int64_t counts[E];
    double psum[E], part[(N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK * (2 * E + 1)], lse2;
    for (int e = 0; e < E; e++) {
        counts[e] = aux_other_counts[e];
        psum[e] = aux_other_psum[e];
    }
    if (a->from_logits) { /* the partials as router_forward writes them */
        router_forward(a->probs, a->lse, a->idx, a->w, part, a->logits, N, E, K, 1);
        if (memcmp(a->idx, a->idx_ref, N * K * sizeof(int32_t)) != 0)
            a->topk_changed = 1;
        lse2 = aux_other_lse2 + router_aux_partials(counts, psum, part, N, E);
    } else {
        lse2 = aux_other_lse2 + given_partials(counts, psum, a);
    }
    double Ng = N + AUX_N_OTHER, aux = 0.0;
    for (int e = 0; e < E; e++)
        aux += (double)counts[e] / (Ng * K) * (psum[e] / Ng);
    aux *= E;
    return coef_aux * aux + coef_z * lse2 / Ng;
}

static void test_router_aux_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { N = AUX_N, E = AUX_E, K = AUX_K };
    aux_ctx a = {buf_zero(&pl, N * E),
                 buf_zero(&pl, N),
                 buf_zero(&pl, N * K),
                 buf_rand(&pl, N * E, 0.1, 2),
                 pool_alloc(&pl, N * K * sizeof(int32_t)),
                 pool_alloc(&pl, N * K * sizeof(int32_t)),
                 1,
                 0};
    router_forward(a.probs, a.lse, a.idx, a.w, NULL, a.logits, N, E, K, 1);
    memcpy(a.idx_ref, a.idx, N * K * sizeof(int32_t));
    int64_t counts[E];
    double psum[E];
    for (int e = 0; e < E; e++) {
        counts[e] = aux_other_counts[e];
        psum[e] = 0.0;
    }
    given_partials(counts, psum, &a);
    int64_t Ng = N + AUX_N_OTHER;

    real *dp0 = buf_rand(&pl, N * E, 0.1, 1), *dp = buf_copy(&pl, dp0, N * E);
    real *dz0 = buf_rand(&pl, N * E, 0.1, 1), *dz = buf_copy(&pl, dz0, N * E);
    router_aux_backward(dp, dz, a.probs, a.lse, counts, Ng, N, E, K, coef_aux, coef_z);
    real *gp = added(&pl, dp, dp0, N * E), *gz = added(&pl, dz, dz0, N * E);

    /* w.r.t. probs (counts and lse held): the aux term's gradient alone */
    a.from_logits = 0;
    assert_true(check_fd("dprobs", a.probs, gp, N * E, E, aux_loss, &a));
    /* w.r.t. logits: softmax backward of dprobs plus the z term */
    a.from_logits = 1;
    real *dl0 = buf_rand(&pl, N * E, 0.1, 1), *dl = buf_copy(&pl, dl0, N * E);
    softmax_backward(dl, gp, a.probs, N, E);
    real *g = added(&pl, dl, dl0, N * E);
    for (int i = 0; i < N * E; i++)
        g[i] += gz[i];
    assert_true(check_fd("dlogits", a.logits, g, N * E, E, aux_loss, &a));
    assert_false(a.topk_changed);

    /* NULL for either gradient leaves the other the same */
    router_forward(a.probs, a.lse, a.idx, a.w, NULL, a.logits, N, E, K, 1);
    real *dpb = buf_copy(&pl, dp0, N * E), *dzb = buf_copy(&pl, dz0, N * E);
    router_aux_backward(dpb, NULL, a.probs, a.lse, counts, Ng, N, E, K, coef_aux, coef_z);
    router_aux_backward(NULL, dzb, a.probs, a.lse, counts, Ng, N, E, K, coef_aux, coef_z);
    assert_memory_equal(dpb, dp, N * E * sizeof(real));
    assert_memory_equal(dzb, dz, N * E * sizeof(real));
    pool_free(&pl);
}

/* ---- permute and combine ---------------------------------------------------------- */

/* A plan over N=5 tokens, K=2, E=3 with capacity 2: expert 0 has 4 assignments, experts
 * 1 and 2 have 3, so 4 of the 10 are dropped. */
enum { RT_N = 5, RT_K = 2, RT_E = 3, RT_D = 4 };
static const int32_t rt_idx[RT_N * RT_K] = {0, 1, 2, 0, 1, 2, 0, 2, 1, 0};

typedef struct {
    int offsets[RT_E + 1];
    int32_t row_token[RT_N * RT_K], row_slot[RT_N * RT_K], slot_row[RT_N * RT_K];
    int M;
} plan;

static void make_plan(plan *p, const real *w)
{
    int scratch[RT_N * RT_K];
    p->M = moe_route_plan(p->offsets, p->row_token, p->row_slot, p->slot_row, scratch, rt_idx, w,
                          RT_N, RT_E, RT_K, RT_N, 2);
    assert_int_equal(p->M, RT_N * RT_K - 4);
}

typedef struct {
    real *y, *y0, *eo, *w, *R, *x;
    const plan *p;
} route_ctx;

static double combine_loss(void *c)
{
    route_ctx *r = c;
    moe_combine_forward(r->y, r->y0, r->eo, r->w, r->p->row_token, r->p->row_slot, r->p->M, RT_D,
                        RT_K, NULL, RT_N); /* y = y0 + the weighted rows */
    return dot(r->R, r->y, RT_N * RT_D);
}

static double permute_loss(void *c)
{
    route_ctx *r = c;
    moe_permute(r->y, r->x, r->p->row_token, r->p->M, RT_D);
    return dot(r->R, r->y, (size_t)r->p->M * RT_D);
}

static void test_moe_combine_backward(void **state)
{
    (void)state;
    pool pl = {0};
    plan p;
    real *w = buf_rand(&pl, RT_N * RT_K, 0.1, 1);
    for (int i = 0; i < RT_N * RT_K; i++)
        w[i] = fabs(w[i]);
    make_plan(&p, w);
    size_t ne = (size_t)p.M * RT_D;
    route_ctx r = {buf_zero(&pl, RT_N * RT_D),
                   buf_rand(&pl, RT_N * RT_D, 0.1, 1),
                   buf_rand(&pl, ne, 0.1, 1),
                   w,
                   buf_rand(&pl, RT_N * RT_D, 0.1, 1),
                   NULL,
                   &p};
    real *de0 = buf_rand(&pl, ne, 0.1, 1), *de = buf_copy(&pl, de0, ne);
    real *dw0 = buf_rand(&pl, RT_N * RT_K, 0.1, 1), *dw = buf_copy(&pl, dw0, RT_N * RT_K);
    moe_combine_backward(de, dw, r.R, r.eo, r.w, p.row_token, p.row_slot, p.M, RT_D, RT_K);
    /* dexpert_out is overwritten (its random start is gone), dw added to */
    assert_true(check_fd("dexpert_out", r.eo, de, ne, RT_D, combine_loss, &r));
    /* dropped slots get a zero gradient: FD agrees, since they contribute nothing */
    assert_true(
        check_fd("dw", r.w, added(&pl, dw, dw0, RT_N * RT_K), RT_N * RT_K, RT_K, combine_loss, &r));

    real *deb = buf_copy(&pl, de0, ne), *dwb = buf_copy(&pl, dw0, RT_N * RT_K);
    moe_combine_backward(deb, NULL, r.R, r.eo, r.w, p.row_token, p.row_slot, p.M, RT_D, RT_K);
    moe_combine_backward(NULL, dwb, r.R, r.eo, r.w, p.row_token, p.row_slot, p.M, RT_D, RT_K);
    assert_memory_equal(deb, de, ne * sizeof(real));
    assert_memory_equal(dwb, dw, RT_N * RT_K * sizeof(real));
    pool_free(&pl);
}

static void test_moe_permute_backward(void **state)
{
    (void)state;
    pool pl = {0};
    plan p;
    real *w = buf_rand(&pl, RT_N * RT_K, 0.1, 1);
    for (int i = 0; i < RT_N * RT_K; i++)
        w[i] = fabs(w[i]);
    make_plan(&p, w);
    size_t ne = (size_t)p.M * RT_D;
    route_ctx r = {buf_zero(&pl, ne),
                   NULL,
                   NULL,
                   w,
                   buf_rand(&pl, ne, 0.1, 1),
                   buf_rand(&pl, RT_N * RT_D, 0.1, 1),
                   &p};
    real *dx0 = buf_rand(&pl, RT_N * RT_D, 0.1, 1), *dx = buf_copy(&pl, dx0, RT_N * RT_D);
    moe_permute_backward(dx, dx, r.R, p.row_token, p.M, RT_D, NULL, 0, 0, NULL); /* added to dx */
    assert_true(
        check_fd("dx", r.x, added(&pl, dx, dx0, RT_N * RT_D), RT_N * RT_D, RT_D, permute_loss, &r));
    /* from another base (N read), and written (base NULL) over random contents */
    real *dxo = buf_rand(&pl, RT_N * RT_D, 0.1, 3);
    moe_permute_backward(dxo, dx0, r.R, p.row_token, p.M, RT_D, NULL, RT_N, 0, NULL);
    assert_memory_equal(dxo, dx, RT_N * RT_D * sizeof(real));
    real *dxw = buf_rand(&pl, RT_N * RT_D, 0.1, 4);
    moe_permute_backward(dxw, NULL, r.R, p.row_token, p.M, RT_D, NULL, RT_N, 0, NULL);
    assert_true(check_fd("dx written", r.x, dxw, RT_N * RT_D, RT_D, permute_loss, &r));
    /* last, added after the rows: the sums above, then last's element */
    real *last = buf_rand(&pl, RT_N * RT_D, 0.1, 5), *dxl = buf_rand(&pl, RT_N * RT_D, 0.1, 6);
    moe_permute_backward(dxl, dx0, r.R, p.row_token, p.M, RT_D, NULL, RT_N, 0, last);
    for (int i = 0; i < RT_N * RT_D; i++)
        assert_true(dxl[i] == dx[i] + last[i]);
    moe_permute_backward(dxl, NULL, r.R, p.row_token, p.M, RT_D, NULL, RT_N, 0, last);
    for (int i = 0; i < RT_N * RT_D; i++)
        assert_true(dxl[i] == dxw[i] + last[i]);
    /* the gradient rows sent back (the tokens as the received rows): [the sums written
     * above | dw], over random contents */
    real *dw = buf_rand(&pl, RT_N * RT_K, 0.1, 7);
    real *rows = buf_rand(&pl, RT_N * (RT_D + RT_K), 0.1, 8);
    moe_pack_grad_rows(rows, r.R, p.row_token, p.M, NULL, dw, RT_N, RT_D, RT_K);
    for (int n = 0; n < RT_N; n++) {
        assert_memory_equal(rows + (size_t)n * (RT_D + RT_K), dxw + (size_t)n * RT_D,
                            RT_D * sizeof(real));
        assert_memory_equal(rows + (size_t)n * (RT_D + RT_K) + RT_D, dw + (size_t)n * RT_K,
                            RT_K * sizeof(real));
    }
    pool_free(&pl);
}

/* ---- cross-entropy ---------------------------------------------------------------- */

typedef struct {
    real *losses, *lse, *logits;
    const int32_t *targets;
    real dloss;
    int N, V;
} ce_ctx;

/* L = dloss * sum_n losses_n (dloss is the one scale of every token). */
static double ce_loss(void *c)
{
    ce_ctx *e = c;
    cross_entropy_forward(e->losses, e->lse, e->logits, e->targets, e->N, e->V);
    double s = 0.0;
    for (int n = 0; n < e->N; n++)
        s += e->losses[n];
    return e->dloss * s;
}

static void test_cross_entropy_backward(void **state)
{
    (void)state;
    pool pl = {0};
    enum { N = 4, V = 7 };
    static const int32_t targets[N] = {3, 0, 6, 3};
    ce_ctx e = {
        buf_zero(&pl, N), buf_zero(&pl, N), buf_rand(&pl, N * V, 0.1, 3), targets, 0.37, N, V};
    ce_loss(&e);
    real *dl = buf_rand(&pl, N * V, 0.1, 1); /* overwritten, not added to */
    cross_entropy_backward(dl, e.logits, e.lse, targets, e.dloss, N, V);
    /* in place (dlogits == logits): the same values (before check_fd moves lse) */
    real *inplace = buf_copy(&pl, e.logits, N * V);
    cross_entropy_backward(inplace, inplace, e.lse, targets, e.dloss, N, V);
    assert_memory_equal(inplace, dl, N * V * sizeof(real));
    assert_true(check_fd("dlogits", e.logits, dl, N * V, V, ce_loss, &e));
    pool_free(&pl);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embedding_backward),
        cmocka_unit_test(test_rmsnorm_backward),
        cmocka_unit_test(test_matmul_backward),
        cmocka_unit_test(test_grouped_matmul_backward),
        cmocka_unit_test(test_swiglu_backward),
        cmocka_unit_test(test_rope_backward),
        cmocka_unit_test(test_attention_backward),
        cmocka_unit_test(test_softmax_backward),
        cmocka_unit_test(test_router_topk_backward),
        cmocka_unit_test(test_router_aux_backward),
        cmocka_unit_test(test_moe_combine_backward),
        cmocka_unit_test(test_moe_permute_backward),
        cmocka_unit_test(test_cross_entropy_backward),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
