/* tests/unit/test_ops.c: properties of the float CPU reference (moe_core) with expected
 * values worked out by hand here, not by the code under test: the routing plan (order,
 * capacity drops, ties, groups), router top-k, attention causality, rope's convention,
 * cross-entropy (and its backward's overwrite, in place too), AdamW, all_finite, matmul against a
 * naive loop, small forwards, and bitwise determinism across thread counts. Gradients are checked
 * in test_ops_f64.c. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "util/rng.h"

static void fill(real *x, size_t n, uint64_t stream)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (real)(2.0 * moe_rng_uniform(7, stream, i) - 1.0);
}

static real *alloc_fill(size_t n, uint64_t stream)
{
    real *x = malloc(n * sizeof(real));
    assert_non_null(x);
    fill(x, n, stream);
    return x;
}

static real *copy_of(const real *x, size_t n)
{
    real *y = malloc(n * sizeof(real));
    assert_non_null(y);
    memcpy(y, x, n * sizeof(real));
    return y;
}

/* |got - want| <= atol + rtol |want| for every element; prints the first mismatches. */
static int close_to(const char *what, const real *got, const double *want, size_t n, double atol,
                    double rtol)
{
    int bad = 0;
    for (size_t i = 0; i < n; i++)
        if (!(fabs(got[i] - want[i]) <= atol + rtol * fabs(want[i]))) {
            if (bad++ < 6)
                fprintf(stderr, "  %s[%zu]: got %.9g, want %.9g\n", what, i, (double)got[i],
                        want[i]);
        }
    return bad == 0;
}

/* ---- routing plan ------------------------------------------------------------------ */

/* N=4 tokens, K=2, E=4 (expert 3 gets no token):
 *   token 0 -> experts {1, 0} weights {0.5, 0.3}
 *   token 1 -> {1, 2}  {0.7, 0.2}
 *   token 2 -> {0, 1}  {0.6, 0.5}
 *   token 3 -> {2, 1}  {0.8, 0.5}
 * Expert 1 has four assignments: t0s0 0.5, t1s0 0.7, t2s1 0.5, t3s1 0.5 (a three-way tie). */
enum { PN = 4, PK = 2, PE = 4 };
static const int32_t plan_idx[PN * PK] = {1, 0, 1, 2, 0, 1, 2, 1};
static const real plan_w[PN * PK] = {0.5f, 0.3f, 0.7f, 0.2f, 0.6f, 0.5f, 0.8f, 0.5f};

typedef struct {
    int M;
    int offsets[PE + 1];
    int32_t row_token[PN * PK], row_slot[PN * PK], slot_row[PN * PK];
} plan_want;

static void check_plan(int group, int capacity, const plan_want *want)
{
    int offsets[PE + 1], scratch[PN * PK];
    int32_t row_token[PN * PK], row_slot[PN * PK], slot_row[PN * PK];
    int M = moe_route_plan(offsets, row_token, row_slot, slot_row, scratch, plan_idx, plan_w, PN,
                           PE, PK, group, capacity);
    if (M != want->M)
        fprintf(stderr, "  plan group=%d capacity=%d: M=%d, want %d\n", group, capacity, M,
                want->M);
    assert_int_equal(M, want->M);
    assert_memory_equal(offsets, want->offsets, sizeof offsets);
    if (M > 0) {
        assert_memory_equal(row_token, want->row_token, (size_t)M * sizeof(int32_t));
        assert_memory_equal(row_slot, want->row_slot, (size_t)M * sizeof(int32_t));
    }
    assert_memory_equal(slot_row, want->slot_row, sizeof slot_row);

    /* offsets not reported: the same rows, -1 returned, the scratch's tail used */
    int scratch2[PN * PK + PE + 1];
    int32_t row_token2[PN * PK], row_slot2[PN * PK], slot_row2[PN * PK];
    assert_int_equal(moe_route_plan(NULL, row_token2, row_slot2, slot_row2, scratch2, plan_idx,
                                    plan_w, PN, PE, PK, group, capacity),
                     -1);
    if (M > 0) {
        assert_memory_equal(row_token2, want->row_token, (size_t)M * sizeof(int32_t));
        assert_memory_equal(row_slot2, want->row_slot, (size_t)M * sizeof(int32_t));
    }
    assert_memory_equal(slot_row2, want->slot_row, sizeof slot_row);
}

static void test_route_plan_dropless(void **state)
{
    (void)state;
    /* by expert, then token, then slot:
     * e0: t0s1 t2s0 | e1: t0s0 t1s0 t2s1 t3s1 | e2: t1s1 t3s0 | e3: none */
    const plan_want want = {8,
                            {0, 2, 6, 8, 8},
                            {0, 2, 0, 1, 2, 3, 1, 3},
                            {1, 0, 0, 0, 1, 1, 1, 0},
                            {2, 0, 3, 6, 1, 4, 7, 5}};
    check_plan(PN, -1, &want);
    check_plan(2, -1, &want); /* groups do not matter without capacity */
    check_plan(PN, 4, &want); /* nor does a capacity nobody exceeds */
}

/* The plan's tokens over 2 ranks: experts 0, 1 on rank 0 and 2, 3 on rank 1 (local ids
 * 0, 1 on each), dropless. Counted by hand:
 *   rank 0 gets t0 (e1, e0), t1 (e1), t2 (e0, e1), t3 (e1): 4 rows, 6 assignments,
 *          local 0 (e0) 2, local 1 (e1) 4;
 *   rank 1 gets t1 (e2), t3 (e2): 2 rows, 2 assignments, local 0 (e2) 2, local 1 0. */
static void test_pack_dispatch(void **state)
{
    (void)state;
    enum { D = 3, P = 2, El = 2 };
    const int32_t erank[PE] = {0, 0, 1, 1}, elocal[PE] = {0, 1, 0, 1};
    int32_t slot_row[PN * PK], row_token[PN * PK], row_slot[PN * PK], send_token[PN * P];
    int offsets[PE + 1], scratch[PN * PK];
    moe_route_plan(offsets, row_token, row_slot, slot_row, scratch, plan_idx, plan_w, PN, PE, PK,
                   PN, -1);
    real x[PN * D];
    for (int i = 0; i < PN * D; i++)
        x[i] = (real)(i + 1);
    const size_t row_bytes = sizeof(real) * (D + PK) + sizeof(int32_t) * PK;
    char rows[PN * P * sizeof(real) * (D + 2 * PK)];
    int counts[MOE_PACK_COUNTS(P, El)];
    int32_t token_rows[PN * P];
    moe_pack_dispatch(rows, send_token, token_rows, counts, x, plan_idx, plan_w, slot_row, erank,
                      elocal, PN, D, PK, P, El, row_bytes, MOE_ROW_FP32);
    /* rows per rank | assignments per rank | rows | per (rank, local expert) */
    const int want[MOE_PACK_COUNTS(P, El)] = {4, 2, 6, 2, 6, 2, 4, 2, 0};
    const int32_t want_token[6] = {0, 1, 2, 3, 1, 3};
    assert_memory_equal(counts, want, sizeof want);
    assert_memory_equal(send_token, want_token, sizeof want_token);
    /* the inverse, (token, rank): t0 row 0 | -, t1 1 | 4, t2 2 | -, t3 3 | 5 */
    const int32_t want_rows[PN * P] = {0, -1, 1, 4, 2, -1, 3, 5};
    assert_memory_equal(token_rows, want_rows, sizeof want_rows);
    /* row 4: token 1 to rank 1, its slot 0 (e1) elsewhere, slot 1 (e2) local 0 there */
    const real *r4 = (const real *)(rows + 4 * row_bytes);
    const int32_t *l4 = (const int32_t *)(r4 + D + PK);
    assert_true(r4[0] == x[3] && r4[2] == x[5]);
    assert_true(r4[D] == 0 && r4[D + 1] == plan_w[3]);
    assert_int_equal(l4[0], -1);
    assert_int_equal(l4[1], 0);

    /* rows NULL: the same counts, tokens and inverse, nothing else read or written */
    int counts0[MOE_PACK_COUNTS(P, El)];
    int32_t send0[PN * P], trows0[PN * P];
    for (int i = 0; i < PN * P; i++)
        send0[i] = trows0[i] = -7;
    memset(counts0, 0x5a, sizeof counts0);
    moe_pack_dispatch(NULL, send0, trows0, counts0, NULL, plan_idx, NULL, slot_row, erank, elocal,
                      PN, D, PK, P, El, 0, MOE_ROW_BF16);
    assert_memory_equal(counts0, want, sizeof want);
    assert_memory_equal(send0, want_token, sizeof want_token);
    assert_int_equal(send0[6], -7);
    assert_memory_equal(trows0, want_rows, sizeof want_rows);

    /* the 16-bit token forms: the same rows, the token rounded, weights and ids as above,
     * and unpacking gives the rounded values back exactly */
    for (int x16 = MOE_ROW_BF16; x16 <= MOE_ROW_FP16; x16++) {
        real xs[PN * D];
        for (int i = 0; i < PN * D; i++)
            xs[i] = 0.1f * (real)(i + 1) + 0.01f; /* not representable in 16 bits */
        const size_t rb = moe_dispatch_row_bytes(D, PK, x16);
        assert_true(rb < row_bytes + 8 && rb % 8 == 0);
        char rows16[PN * P * sizeof(real) * (D + 2 * PK)];
        moe_pack_dispatch(rows16, send_token, NULL, counts, xs, plan_idx, plan_w, slot_row, erank,
                          elocal, PN, D, PK, P, El, rb, x16);
        assert_memory_equal(counts, want, sizeof want);
        real ux[6 * D], uw[6 * PK];
        int32_t ul[6 * PK];
        moe_unpack_dispatch(ux, uw, ul, rows16, 6, D, PK, rb, x16);
        for (int r = 0; r < 6; r++)
            for (int j = 0; j < D; j++) {
                const real v = xs[want_token[r] * D + j];
                const real want_v = x16 == MOE_ROW_BF16 ? moe_bf16_widen(moe_bf16_round(v))
                                                        : moe_fp16_widen(moe_fp16_round(v));
                assert_true(ux[r * D + j] == want_v && want_v != v);
                assert_true(fabsf(want_v - v) <= (x16 == MOE_ROW_BF16 ? 0x1p-8f : 0x1p-11f) *
                                                     fabsf(v)); /* half an ulp */
            }
        assert_true(uw[4 * PK] == 0 && uw[4 * PK + 1] == plan_w[3]);
        assert_int_equal(ul[4 * PK], -1);
        assert_int_equal(ul[4 * PK + 1], 0);
        /* the tokens straight from the rows into expert order (repeats, any order): the
         * unpacked rows permuted; x NULL: the weights and ids alone */
        const int32_t order[7] = {5, 0, 4, 4, 2, 1, 3};
        real px[7 * D], uw0[6 * PK];
        int32_t ul0[6 * PK];
        moe_permute_rows(px, rows16, rb, x16, order, 7, D);
        for (int m = 0; m < 7; m++)
            assert_memory_equal(px + m * D, ux + order[m] * D, sizeof(real) * D);
        moe_unpack_dispatch(NULL, uw0, ul0, rows16, 6, D, PK, rb, x16);
        assert_memory_equal(uw0, uw, sizeof uw);
        assert_memory_equal(ul0, ul, sizeof ul);
    }
    real px[3 * D];
    const int32_t order[3] = {4, 4, 1};
    moe_permute_rows(px, rows, row_bytes, MOE_ROW_FP32, order, 3, D);
    for (int m = 0; m < 3; m++)
        assert_memory_equal(px + m * D, rows + order[m] * row_bytes, sizeof(real) * D);
}

/* The gradient rows back to their tokens: dx = base + the rows' dx parts (row order), dw =
 * their dw parts, written; a token without rows gets its base and a zero dw. */
static void test_scatter_grad_rows(void **state)
{
    (void)state;
    enum { N = 3, D = 2, K = 2, n = 3 };
    const int32_t send_token[n] = {2, 0, 2};
    const real rows[n * (D + K)] = {1, 2, 0.5f, 0.25f, 3, 4, 1, 2, 5, 6, 0.125f, 4};
    const real base[N * D] = {10, 20, 30, 40, 50, 60};
    real dx[N * D], dw[N * K], dxa[N * D];
    for (int i = 0; i < N * D; i++)
        dx[i] = NAN, dxa[i] = base[i];
    for (int i = 0; i < N * K; i++)
        dw[i] = NAN;
    moe_scatter_grad_rows(dx, dw, base, rows, send_token, n, D, K, NULL, N, 1);
    const real want_dx[N * D] = {13, 24, 30, 40, 56, 68};
    const real want_dw[N * K] = {1, 2, 0, 0, 0.625f, 4.25f};
    assert_memory_equal(dx, want_dx, sizeof dx);
    assert_memory_equal(dw, want_dw, sizeof dw);
    /* base = dx: added to what dx holds; base NULL: from 0 */
    moe_scatter_grad_rows(dxa, dw, dxa, rows, send_token, n, D, K, NULL, N, 1);
    assert_memory_equal(dxa, want_dx, sizeof dxa);
    moe_scatter_grad_rows(dx, dw, NULL, rows, send_token, n, D, K, NULL, N, 1);
    const real want_0[N * D] = {3, 4, 0, 0, 6, 8};
    assert_memory_equal(dx, want_0, sizeof dx);
}

/* The host's fp16 and bf16 rounding on values whose encodings are known: ties to even,
 * the largest finite, overflow, subnormals, the smallest normal, signs, NaN. */
static void test_half_rounding(void **state)
{
    (void)state;
    static const struct {
        float v;
        uint16_t h;
    } fp16[] = {
        {1.0f, 0x3c00},
        {-2.0f, 0xc000},
        {1.0f + 0x1p-11f, 0x3c00}, /* a tie: to even */
        {1.0f + 0x3p-11f, 0x3c02}, /* a tie: to even, up */
        {65504.0f, 0x7bff},
        {65519.99f, 0x7bff},
        {65520.0f, 0x7c00}, /* a tie at the top: to infinity */
        {1e6f, 0x7c00},
        {-1e6f, 0xfc00},
        {0x1p-14f, 0x0400},            /* the smallest normal */
        {0x1p-14f - 0x1p-24f, 0x03ff}, /* the largest subnormal */
        {0x1p-24f, 0x0001},
        {0x1p-25f, 0x0000}, /* half a unit, a tie: to even, zero */
        {0x3p-26f, 0x0001}, /* 0.75 units */
        {0x3p-25f, 0x0002}, /* 1.5 units, a tie: to even, 2 */
        {0x1p-26f, 0x0000},
        {-0.0f, 0x8000},
        {0.0f, 0x0000},
        {0x1.ffcp-15f, 0x0400}, /* rounds up into the normals */
    };
    for (size_t i = 0; i < sizeof fp16 / sizeof *fp16; i++) {
        assert_int_equal(moe_fp16_round(fp16[i].v), fp16[i].h);
        if (fp16[i].v == moe_fp16_widen(fp16[i].h)) /* exact ones come back */
            assert_true(moe_fp16_widen(moe_fp16_round(fp16[i].v)) == fp16[i].v);
    }
    assert_true(moe_fp16_widen(0x0001) == 0x1p-24f && moe_fp16_widen(0x7bff) == 65504.0f);
    assert_true(isinf(moe_fp16_widen(0x7c00)) && isnan(moe_fp16_widen(moe_fp16_round(NAN))));
    assert_int_equal(moe_bf16_round(1.0f), 0x3f80);
    assert_int_equal(moe_bf16_round(1.0f + 0x1p-8f), 0x3f80); /* a tie: to even */
    assert_int_equal(moe_bf16_round(1.0f + 0x3p-8f), 0x3f82);
}

static void test_route_plan_capacity(void **state)
{
    (void)state;
    /* one group, capacity 2: expert 1 keeps t1s0 (0.7) and, of the three tied at 0.5,
     * the lowest token t0s0; t2s1 and t3s1 are dropped. */
    const plan_want cap2 = {
        6, {0, 2, 4, 6, 6}, {0, 2, 0, 1, 1, 3}, {1, 0, 0, 0, 1, 0}, {2, 0, 3, 4, 1, -1, 5, -1}};
    check_plan(PN, 2, &cap2);
    check_plan(0, 2, &cap2); /* group <= 0 is taken as one group of all N tokens */

    /* one group, capacity 1: the weight decides before the token index:
     * e0 keeps t2s0 (0.6 over t0s1 0.3), e1 keeps t1s0 (0.7), e2 keeps t3s0 (0.8). */
    const plan_want cap1 = {
        3, {0, 1, 2, 3, 3}, {2, 1, 3}, {0, 0, 0}, {-1, -1, 1, -1, 0, -1, 2, -1}};
    check_plan(PN, 1, &cap1);

    /* two groups of 2 tokens, capacity 1 per group:
     * group {t0,t1}: e0 t0s1; e1 t1s0 (0.7 over t0s0 0.5); e2 t1s1.
     * group {t2,t3}: e0 t2s0; e1 t2s1 (tie 0.5 with t3s1: lower token); e2 t3s0. */
    const plan_want groups = {
        6, {0, 2, 4, 6, 6}, {0, 2, 1, 2, 1, 3}, {1, 0, 0, 1, 1, 0}, {-1, 0, 2, 4, 1, 3, 5, -1}};
    check_plan(2, 1, &groups);

    /* capacity 0: everything dropped */
    const plan_want none = {0, {0, 0, 0, 0, 0}, {0}, {0}, {-1, -1, -1, -1, -1, -1, -1, -1}};
    check_plan(PN, 0, &none);
}

/* permute and combine on the capacity-1 plan: rows r0 = t2s0, r1 = t1s0, r2 = t3s0. */
static void test_permute_combine_forward(void **state)
{
    (void)state;
    enum { D = 2, M = 3 };
    const int32_t row_token[M] = {2, 1, 3}, row_slot[M] = {0, 0, 0};
    const real x[PN * D] = {1, 2, 3, 4, 5, 6, 7, 8};
    real out[M * D];
    moe_permute(out, x, row_token, M, D);
    const real want_out[M * D] = {5, 6, 3, 4, 7, 8};
    assert_memory_equal(out, want_out, sizeof out);

    const real eo[M * D] = {1, 1, 2, 2, 3, 3};
    real y[PN * D] = {1, 1, 1, 1, 1, 1, 1, 1};
    moe_combine_forward(y, y, eo, plan_w, row_token, row_slot, M, D, PK, NULL, 0);
    /* token 0: all dropped; t1: 0.7*2; t2: 0.6*1; t3: 0.8*3, each added to 1 */
    const double want_y[PN * D] = {1,       1,       1 + 0.7 * 2, 1 + 0.7 * 2,
                                   1 + 0.6, 1 + 0.6, 1 + 0.8 * 3, 1 + 0.8 * 3};
    assert_true(close_to("y", y, want_y, PN * D, 1e-6, 1e-6));
    /* from a base of 2 into a buffer of NaN, and written (base NULL): token 0 gets its base */
    const real two[PN * D] = {2, 2, 2, 2, 2, 2, 2, 2};
    real yb[PN * D], yw[PN * D];
    for (int i = 0; i < PN * D; i++)
        yb[i] = yw[i] = NAN;
    moe_combine_forward(yb, two, eo, plan_w, row_token, row_slot, M, D, PK, NULL, PN);
    moe_combine_forward(yw, NULL, eo, plan_w, row_token, row_slot, M, D, PK, NULL, PN);
    double want_b[PN * D], want_w[PN * D];
    for (int i = 0; i < PN * D; i++) {
        want_b[i] = want_y[i] + 1;
        want_w[i] = want_y[i] - 1;
    }
    assert_true(close_to("y from base 2", yb, want_b, PN * D, 1e-6, 1e-6));
    assert_true(close_to("y written", yw, want_w, PN * D, 1e-6, 1e-6));
}

/* ---- router --------------------------------------------------------------------- */

static void test_router_forward(void **state)
{
    (void)state;
    enum { N = 3, E = 4, K = 2 };
    const real logits[N * E] = {1,    3,  3, 0,    /* tie between experts 1 and 2 */
                                0.5f, -1, 2, 0.5f, /* top 2, then tie 0 / 3 */
                                0,    0,  0, 0};   /* all tied */
    double want_p[N * E], want_lse[N];
    for (int n = 0; n < N; n++) {
        double s = 0.0;
        for (int e = 0; e < E; e++)
            s += exp((double)logits[n * E + e]);
        want_lse[n] = log(s);
        for (int e = 0; e < E; e++)
            want_p[n * E + e] = exp((double)logits[n * E + e]) / s;
    }
    const int32_t want_idx[N * K] = {1, 2, 2, 0, 0, 1};
    real probs[N * E], lse[N], w[N * K];
    int32_t idx[N * K];

    router_forward(probs, lse, idx, w, NULL, logits, N, E, K, 0);
    assert_true(close_to("probs", probs, want_p, N * E, 1e-7, 1e-6));
    assert_true(close_to("lse", lse, want_lse, N, 1e-6, 1e-6));
    assert_memory_equal(idx, want_idx, sizeof idx);
    const double want_w[N * K] = {want_p[1], want_p[2], want_p[6], want_p[4], 0.25, 0.25};
    assert_true(close_to("w", w, want_w, N * K, 1e-7, 1e-6));

    router_forward(probs, lse, idx, w, NULL, logits, N, E, K, 1);
    assert_memory_equal(idx, want_idx, sizeof idx);
    const double e2 = exp(2.0), e05 = exp(0.5);
    const double want_wr[N * K] = {0.5, 0.5, e2 / (e2 + e05), e05 / (e2 + e05), 0.5, 0.5};
    assert_true(close_to("w renorm", w, want_wr, N * K, 1e-7, 1e-6));

    /* K = E: every expert, in decreasing order */
    int32_t idx4[N * E];
    real w4[N * E];
    router_forward(probs, lse, idx4, w4, NULL, logits, N, E, E, 0);
    const int32_t want_idx4[N * E] = {1, 2, 0, 3, 2, 0, 3, 1, 0, 1, 2, 3};
    assert_memory_equal(idx4, want_idx4, sizeof idx4);
}

/* The partials written by router_forward, chunk by chunk, against sums by hand over
 * 150 rows (3 chunks, the last one partial), added to what counts and psum held. */
static void test_router_aux_partials(void **state)
{
    (void)state;
    enum { N = 150, E = 3, K = 2 };
    real logits[N * E], probs[N * E], lse[N], w[N * K];
    int32_t idx[N * K];
    for (int i = 0; i < N * E; i++)
        logits[i] = (real)((i * 7919 % 23) * 0.25 - 2.5); /* a fixed, varied pattern */
    double part[(N + MOE_AUX_CHUNK - 1) / MOE_AUX_CHUNK * (2 * E + 1)];
    assert_int_equal(router_aux_part_len(N, E), sizeof part / sizeof part[0]);
    router_forward(probs, lse, idx, w, part, logits, N, E, K, 1);
    int64_t counts[E] = {5, 0, 0}, want_c[E] = {5, 0, 0};
    double psum[E] = {1, 0, 0}, want_p[E] = {1, 0, 0}, want_l = 0.0;
    for (int n = 0; n < N; n++) {
        for (int k = 0; k < K; k++)
            want_c[idx[n * K + k]]++;
        for (int e = 0; e < E; e++)
            want_p[e] += exp((double)logits[n * E + e] - (double)lse[n]);
        want_l += (double)lse[n] * lse[n];
    }
    double lse2 = router_aux_partials(counts, psum, part, N, E);
    assert_true(fabs(lse2 - want_l) <= 1e-9 * want_l);
    for (int e = 0; e < E; e++) {
        assert_int_equal(counts[e], want_c[e]);
        assert_true(fabs(psum[e] - want_p[e]) <= 1e-6 * want_p[e]);
    }
    assert_int_equal(counts[0] + counts[1] + counts[2], 5 + N * K);
}

/* ---- attention ------------------------------------------------------------------ */

static void test_attention_causal(void **state)
{
    (void)state;
    enum { B = 2, T = 6, H = 2, Hd = 4, LD = H * Hd };
    size_t n = B * T * LD;
    real *q = alloc_fill(n, 1), *k = alloc_fill(n, 2), *v = alloc_fill(n, 3);
    real *out1 = malloc(n * sizeof(real)), *out2 = malloc(n * sizeof(real));
    real lse1[B * H * T], lse2[B * H * T];
    attention_forward(out1, lse1, q, k, v, B, T, H, Hd);

    /* change q, k and v of positions 4 and 5 of sequence 0, every head */
    for (int t = 4; t < T; t++)
        for (int c = 0; c < LD; c++) {
            q[t * LD + c] += 0.5f;
            k[t * LD + c] -= 0.75f;
            v[t * LD + c] += 1.0f;
        }
    attention_forward(out2, lse2, q, k, v, B, T, H, Hd);
    /* earlier positions and the other sequence: bitwise unchanged */
    assert_memory_equal(out1, out2, 4 * LD * sizeof(real));
    assert_memory_equal(out1 + T * LD, out2 + T * LD, T * LD * sizeof(real));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            int t_end = b == 0 ? 4 : T;
            assert_memory_equal(lse1 + (b * H + h) * T, lse2 + (b * H + h) * T,
                                t_end * sizeof(real));
        }
    /* the changed positions do change */
    assert_memory_not_equal(out1 + 4 * LD, out2 + 4 * LD, 2 * LD * sizeof(real));
    free(q), free(k), free(v), free(out1), free(out2);
}

static void test_attention_t1(void **state)
{
    (void)state;
    enum { B = 2, T = 1, H = 2, Hd = 4, LD = H * Hd };
    size_t n = B * T * LD;
    real *q = alloc_fill(n, 4), *k = alloc_fill(n, 5), *v = alloc_fill(n, 6);
    real out[B * T * LD], lse[B * H * T];
    attention_forward(out, lse, q, k, v, B, T, H, Hd);
    assert_memory_equal(out, v, sizeof out); /* one key: probability exactly 1 */
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++) {
            double s = 0.0;
            for (int d = 0; d < Hd; d++)
                s += (double)q[b * LD + h * Hd + d] * k[b * LD + h * Hd + d];
            double want = s / 2.0; /* scale 1/sqrt(4) */
            assert_true(close_to("lse", &lse[b * H + h], &want, 1, 1e-6, 1e-6));
        }
    free(q), free(k), free(v);
}

/* ---- rope ----------------------------------------------------------------------- */

/* Row `row` of [dq | dk | dv] (rows of 3 ld) is r[0]'s row, then r[1]'s, then r[2]'s. */
static void assert_qkv_rows(const real *qkv, real *const r[3], int rows, int ld)
{
    for (int row = 0; row < rows; row++)
        for (int a = 0; a < 3; a++)
            assert_memory_equal(qkv + (size_t)row * 3 * ld + (size_t)a * ld,
                                r[a] + (size_t)row * ld, (size_t)ld * sizeof(real));
}

static void test_rope(void **state)
{
    (void)state;
    enum { B = 2, T = 5, H = 2, Hd = 8, HALF = Hd / 2, LD = H * Hd };
    const double theta = 10000.0;
    real cos_t[T * HALF], sin_t[T * HALF];
    rope_tables(cos_t, sin_t, T, Hd, theta);
    double want_c[T * HALF], want_s[T * HALF];
    for (int t = 0; t < T; t++)
        for (int i = 0; i < HALF; i++) {
            double ang = t * pow(theta, -2.0 * i / Hd);
            want_c[t * HALF + i] = cos(ang);
            want_s[t * HALF + i] = sin(ang);
        }
    assert_true(close_to("cos", cos_t, want_c, T * HALF, 1e-7, 1e-6));
    assert_true(close_to("sin", sin_t, want_s, T * HALF, 1e-7, 1e-6));

    size_t n = B * T * LD;
    real *x = alloc_fill(n, 8), *y = copy_of(x, n);
    rope_forward(y, cos_t, sin_t, B, T, H, Hd);
    /* position 0 of each sequence: unchanged, bit for bit */
    assert_memory_equal(y, x, LD * sizeof(real));
    assert_memory_equal(y + T * LD, x + T * LD, LD * sizeof(real));
    assert_memory_not_equal(y + LD, x + LD, LD * sizeof(real));
    /* backward of forward is the identity (the rotation is orthogonal) */
    rope_backward(y, cos_t, sin_t, B, T, H, Hd);
    double *want = malloc(n * sizeof(double));
    for (size_t i = 0; i < n; i++)
        want[i] = x[i];
    assert_true(close_to("roundtrip", y, want, n, 1e-6, 1e-6));

    /* the pairing and the sign, as rotate_half: at t = 3, head 1, pair i = 1:
     * e_i -> cos e_i + sin e_{i+half}; e_{i+half} -> -sin e_i + cos e_{i+half} */
    real z[B * T * LD];
    memset(z, 0, sizeof z);
    z[3 * LD + Hd + 1] = 1;
    z[(T + 3) * LD + Hd + 1 + HALF] = 1; /* sequence 1, same position: the other unit */
    rope_forward(z, cos_t, sin_t, B, T, H, Hd);
    double ang = 3 * pow(theta, -2.0 / Hd);
    const double want_a[2] = {cos(ang), sin(ang)}, want_b[2] = {-sin(ang), cos(ang)};
    const real got_a[2] = {z[3 * LD + Hd + 1], z[3 * LD + Hd + 1 + HALF]};
    const real got_b[2] = {z[(T + 3) * LD + Hd + 1], z[(T + 3) * LD + Hd + 1 + HALF]};
    assert_true(close_to("rot e_i", got_a, want_a, 2, 1e-7, 1e-6));
    assert_true(close_to("rot e_i+half", got_b, want_b, 2, 1e-7, 1e-6));

    /* rope_backward_qkv: each row of [dq | dk | dv] is dq's and dk's rows rotated back as
     * rope_backward rotates them, then dv's row as it is */
    real *g[3], *r[3], *qkv = malloc(3 * n * sizeof(real));
    for (int a = 0; a < 3; a++) {
        g[a] = alloc_fill(n, 20 + a);
        r[a] = copy_of(g[a], n);
    }
    rope_backward(r[0], cos_t, sin_t, B, T, H, Hd);
    rope_backward(r[1], cos_t, sin_t, B, T, H, Hd);
    rope_backward_qkv(qkv, g[0], g[1], g[2], cos_t, sin_t, B, T, H, Hd);
    assert_qkv_rows(qkv, r, B * T, LD);
    for (int a = 0; a < 3; a++)
        free(g[a]), free(r[a]);
    free(qkv);
    free(x), free(y), free(want);
}

/* attention_backward_qkv: [dq | dk | dv] row by row is attention_backward's dq and dk
 * rotated back by rope_backward, then its dv as it is (dq, dk, dv: the op's scratch) */
static void test_attention_backward_qkv(void **state)
{
    (void)state;
    enum { B = 2, T = 7, H = 2, Hd = 8, LD = H * Hd };
    const size_t n = (size_t)B * T * LD;
    real cos_t[T * Hd / 2], sin_t[T * Hd / 2];
    rope_tables(cos_t, sin_t, T, Hd, 10000.0);
    real *q = alloc_fill(n, 30), *k = alloc_fill(n, 31), *v = alloc_fill(n, 32);
    real *dout = alloc_fill(n, 33), *att = malloc(n * sizeof(real));
    real *lse = malloc((size_t)B * H * T * sizeof(real));
    attention_forward(att, lse, q, k, v, B, T, H, Hd);
    real *r[3], *s[3], *qkv = malloc(3 * n * sizeof(real));
    for (int a = 0; a < 3; a++) {
        r[a] = malloc(n * sizeof(real));
        s[a] = alloc_fill(n, 40 + a); /* scratch with values in it */
    }
    attention_backward(r[0], r[1], r[2], dout, att, lse, q, k, v, B, T, H, Hd);
    rope_backward(r[0], cos_t, sin_t, B, T, H, Hd);
    rope_backward(r[1], cos_t, sin_t, B, T, H, Hd);
    attention_backward_qkv(qkv, s[0], s[1], s[2], dout, att, lse, q, k, v, cos_t, sin_t, B, T, H,
                           Hd);
    assert_qkv_rows(qkv, r, B * T, LD);
    for (int a = 0; a < 3; a++)
        free(r[a]), free(s[a]);
    free(q), free(k), free(v), free(dout), free(att), free(lse), free(qkv);
}

/* ---- loss and optimizer ----------------------------------------------------------- */

static void test_cross_entropy_forward(void **state)
{
    (void)state;
    enum { N = 3, V = 5 };
    const real logits[N * V] = {1, 2, 3, 4, 5, -1, 0.5f, 0, 2, -3, 10, 10, 10, 10, 10};
    const int32_t targets[N] = {4, 0, 2};
    double want[N], want_lse[N];
    for (int n = 0; n < N; n++) { /* -log softmax, directly */
        double s = 0.0;
        for (int v = 0; v < V; v++)
            s += exp((double)logits[n * V + v]);
        want[n] = -log(exp((double)logits[n * V + targets[n]]) / s);
        want_lse[n] = log(s);
    }
    real losses[N], lse[N];
    cross_entropy_forward(losses, lse, logits, targets, N, V);
    assert_true(close_to("loss", losses, want, N, 1e-6, 1e-6));
    assert_true(close_to("lse", lse, want_lse, N, 1e-6, 1e-6));
    assert_true(fabs(losses[2] - log(5.0)) < 1e-6); /* uniform logits: log V */
}

/* The backward overwrites dlogits (pre-filled with nonzero values) with dloss * (softmax -
 * onehot), the softmax taken here directly (exp / sum of exp, not through lse); the
 * in-place form (dlogits == logits) gives the same bits. N*V of the second shape is above
 * the reference's threshold for threads. */
static void check_cross_entropy_backward(int N, int V)
{
    const size_t NV = (size_t)N * V;
    real *logits = alloc_fill(NV, 30), *dl = alloc_fill(NV, 31);
    for (size_t i = 0; i < NV; i++)
        logits[i] *= 4; /* in [-4, 4] */
    int32_t *targets = malloc(sizeof(int32_t) * N);
    real *losses = malloc(sizeof(real) * N), *lse = malloc(sizeof(real) * N);
    double *want = malloc(sizeof(double) * NV);
    assert_true(targets && losses && lse && want);
    for (int n = 0; n < N; n++)
        targets[n] = (int32_t)(moe_rng_u64(7, 32, n) % (uint64_t)V);
    const real dloss = 0.37f;
    for (int n = 0; n < N; n++) {
        const real *l = logits + (size_t)n * V;
        double s = 0.0;
        for (int v = 0; v < V; v++)
            s += exp((double)l[v]);
        for (int v = 0; v < V; v++)
            want[(size_t)n * V + v] = dloss * (exp((double)l[v]) / s - (v == targets[n]));
    }
    cross_entropy_forward(losses, lse, logits, targets, N, V);
    cross_entropy_backward(dl, logits, lse, targets, dloss, N, V);
    assert_true(close_to("dlogits", dl, want, NV, 1e-7, 1e-5));

    real *inplace = copy_of(logits, NV);
    cross_entropy_backward(inplace, inplace, lse, targets, dloss, N, V);
    assert_memory_equal(inplace, dl, NV * sizeof(real));
    free(logits), free(dl), free(targets), free(losses), free(lse), free(want), free(inplace);
}

static void test_cross_entropy_backward(void **state)
{
    (void)state;
    check_cross_entropy_backward(5, 37);
    check_cross_entropy_backward(64, 1031);
}

/* The gradients' factor against its definition, computed here by hand. */
static void test_adamw_factor(void **state)
{
    (void)state;
    const double sq[2] = {9, 16}; /* norm 5 before the loss scale */
    /* loss scale 4: norm 1.25; clip 1: factor 0.8 / 4, rounded to float */
    assert_true(moe_adamw_factor(sq, 1.0, 4.0) == (double)0.2f);
    assert_true(moe_adamw_factor(sq, 0.0, 4.0) == 0.25);                /* no clipping */
    assert_true(moe_adamw_factor(sq, 10.0, 1.0) == 1.0);                /* under the clip */
    assert_true(moe_adamw_factor(sq, 2.5, 1.0) == 0.5);                 /* clip / norm */
    const double bad[3][2] = {{NAN, 1}, {1, INFINITY}, {1e308, 1e308}}; /* the last overflows */
    for (int i = 0; i < 3; i++)
        assert_true(moe_adamw_factor(bad[i], 1.0, 1.0) == -1.0);
}

/* The multi-tensor step equals the per-tensor step on each segment, with its own weight
 * decay; a gradient factor of 0.5 (exact in float), from the loss scale or from clipping,
 * equals halving the gradients first; a non-finite norm changes nothing. */
static void test_adamw_update_multi(void **state)
{
    (void)state;
    enum { n = 11, segs = 3 };
    const int64_t offsets[segs + 1] = {0, 4, 5, 11};
    const real wd[segs] = {0.1f, 0.0f, 0.3f};
    real p0[n], g[n], half[n], m0[n], v0[n];
    for (int i = 0; i < n; i++) {
        p0[i] = (real)(0.3 * i - 1.0);
        g[i] = (real)(0.05 * (i % 5) - 0.11);
        half[i] = g[i] * 0.5f;
        m0[i] = (real)(0.01 * i);
        v0[i] = (real)(1e-4 * (i + 1));
    }
    real p[n], m[n], v[n], pr[n], mr[n], vr[n];
    memcpy(pr, p0, sizeof p), memcpy(mr, m0, sizeof m), memcpy(vr, v0, sizeof v);
    for (int s = 0; s < segs; s++) {
        size_t lo = (size_t)offsets[s], len = (size_t)(offsets[s + 1] - offsets[s]);
        adamw_update(pr + lo, half + lo, mr + lo, vr + lo, len, 0.01f, 0.9f, 0.95f, 1e-8f, wd[s],
                     4);
    }
    /* {sums of squares, clip, loss scale}: norm 5, scale 2, no clip; norm 5, clip 2.5 */
    const double how[2][4] = {{9, 16, 0.0, 2.0}, {9, 16, 2.5, 1.0}};
    for (int k = 0; k < 2; k++) {
        memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
        adamw_update_multi(p, g, m, v, 0, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f,
                           how[k], how[k][2], how[k][3], 4, NULL, 0);
        assert_memory_equal(p, pr, sizeof p);
        assert_memory_equal(m, mr, sizeof m);
        assert_memory_equal(v, vr, sizeof v);
    }
    /* the decay differs per segment: segment 1 has none */
    assert_true(p[4] != p0[4]); /* it still moves with its gradient */
    /* no norm: the factor is 1 / loss scale; the sums of squares come out of the same call,
     * split inside segment 2 (sq_out[0]: elements 0..6, [1]: 7..10) */
    double sq_out[2] = {-1, -1}, want[2] = {0, 0};
    for (int i = 0; i < n; i++)
        want[i >= 7] += (double)g[i] * (double)g[i];
    memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
    adamw_update_multi(p, g, m, v, 0, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f, NULL,
                       0.0, 2.0, 4, sq_out, 7);
    assert_memory_equal(p, pr, sizeof p);
    assert_memory_equal(m, mr, sizeof m);
    assert_memory_equal(v, vr, sizeof v);
    assert_true(fabs(sq_out[0] - want[0]) <= 1e-15 * want[0] && want[0] > 0);
    assert_true(fabs(sq_out[1] - want[1]) <= 1e-15 * want[1] && want[1] > 0);
    /* without a norm nothing is skipped: a NaN gradient reaches the step and the sums */
    real gn[n];
    memcpy(gn, g, sizeof gn);
    gn[9] = NAN;
    memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
    adamw_update_multi(p, gn, m, v, 0, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f, NULL,
                       0.0, 1.0, 4, sq_out, 7);
    assert_true(isnan(p[9]) && !isnan(p[8]));
    assert_true(sq_out[0] == want[0] && isnan(sq_out[1]));
    const double inf_sq[2] = {INFINITY, 1};
    memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
    adamw_update_multi(p, g, m, v, 0, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f, inf_sq,
                       1.0, 1.0, 4, sq_out, 7);
    assert_memory_equal(p, p0, sizeof p);
    assert_memory_equal(m, m0, sizeof m);
    assert_memory_equal(v, v0, sizeof v);
    assert_true(sq_out[0] == 0 && sq_out[1] == 0); /* skipped: nothing read */
}

/* The update in pieces: pieces [lo, hi) that cover the arena once, their ends inside
 * segments and across the split, give the whole step's bits; each piece's sums of
 * squares are its own elements' (below and from the split); an empty piece writes zeros
 * and changes nothing; elements outside a piece are not touched. */
static void test_adamw_update_pieces(void **state)
{
    (void)state;
    enum { n = 23, segs = 4 };
    const int64_t offsets[segs + 1] = {0, 6, 7, 15, 23};
    const real wd[segs] = {0.1f, 0.0f, 0.3f, 0.05f};
    const size_t split = 10, cut[] = {0, 3, 3, 9, 14, 22, 23}; /* pieces [cut[i], cut[i+1]) */
    real p0[n], g[n], m0[n], v0[n], p[n], m[n], v[n];
    for (int i = 0; i < n; i++) {
        p0[i] = (real)(0.3 * sin(1.7 * i) - 0.2);
        g[i] = (real)(0.07 * cos(2.3 * i + 0.4));
        m0[i] = (real)(0.01 * sin(0.9 * i));
        v0[i] = (real)(1e-4 * (1.5 + cos(1.1 * i)));
    }
    double whole[2], sum[2] = {0, 0};
    memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
    adamw_update_multi(p, g, m, v, 0, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f, NULL,
                       0.0, 1.0, 5, whole, split);
    real pw[n], mw[n], vw[n];
    memcpy(pw, p, sizeof p), memcpy(mw, m, sizeof m), memcpy(vw, v, sizeof v);
    memcpy(p, p0, sizeof p), memcpy(m, m0, sizeof m), memcpy(v, v0, sizeof v);
    for (size_t c = 0; c + 1 < sizeof cut / sizeof cut[0]; c++) {
        const size_t lo = cut[c], hi = cut[c + 1];
        double sq[2] = {-1, -1}, want[2] = {0, 0};
        for (size_t i = lo; i < hi; i++)
            want[i >= split] += (double)g[i] * (double)g[i];
        real before[n];
        memcpy(before, p, sizeof p);
        adamw_update_multi(p, g, m, v, 0, n, lo, hi, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f,
                           NULL, 0.0, 1.0, 5, sq, split);
        for (size_t i = 0; i < n; i++) /* inside: changed; outside: as before */
            assert_true((i >= lo && i < hi) ? p[i] != before[i] : p[i] == before[i]);
        for (int k = 0; k < 2; k++) {
            assert_true(fabs(sq[k] - want[k]) <= 1e-15 * want[k]);
            sum[k] += sq[k];
        }
    }
    assert_memory_equal(p, pw, sizeof p);
    assert_memory_equal(m, mw, sizeof m);
    assert_memory_equal(v, vw, sizeof v);
    for (int k = 0; k < 2; k++)
        assert_true(fabs(sum[k] - whole[k]) <= 1e-14 * whole[k] && whole[k] > 0);
}

/* bf16 rounding against hand-made cases: nearest, ties to even, NaN kept, exact widening. */
static void test_bf16_round(void **state)
{
    (void)state;
    assert_int_equal(moe_bf16_round(1.0f), 0x3f80);
    assert_int_equal(moe_bf16_round(-2.0f), 0xc000);
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to the even 1 */
    assert_int_equal(moe_bf16_round(1.0f + 0x1p-8f), 0x3f80);
    /* 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to the even 1 + 2^-6 */
    assert_int_equal(moe_bf16_round(1.0f + 3 * 0x1p-8f), 0x3f82);
    assert_int_equal(moe_bf16_round(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81); /* above halfway */
    assert_true(isnan(moe_bf16_widen(moe_bf16_round(NAN))));
    assert_true(moe_bf16_widen(moe_bf16_round(INFINITY)) == INFINITY);
    for (uint32_t b = 0; b < 0x7f80; b += 37) /* every finite positive pattern widens exactly */
        assert_int_equal(moe_bf16_round(moe_bf16_widen((uint16_t)b)), b);
}

/* With bf16 moments the step equals the fp32-moment step on the widened moments, with the
 * new moments rounded: computed here element by element from adamw_update. */
static void test_adamw_bf16_moments(void **state)
{
    (void)state;
    enum { n = 9, segs = 2 };
    const int64_t offsets[segs + 1] = {0, 5, 9};
    const real wd[segs] = {0.1f, 0.0f};
    const double sq[2] = {0.5, 0.25};
    real p[n], g[n], pr[n], mr[n], vr[n];
    uint16_t m16[n], v16[n];
    for (int i = 0; i < n; i++) {
        p[i] = pr[i] = (real)(0.2 * i - 0.7);
        g[i] = (real)(0.03 * (i % 4) - 0.05);
        m16[i] = moe_bf16_round((float)(0.01 * i - 0.03));
        v16[i] = moe_bf16_round((float)(1e-4 * (i + 2)));
        mr[i] = moe_bf16_widen(m16[i]);
        vr[i] = moe_bf16_widen(v16[i]);
    }
    adamw_update_multi(p, g, m16, v16, 1, n, 0, n, offsets, wd, segs, 0.01f, 0.9f, 0.95f, 1e-8f, sq,
                       0.0, 1.0, 3, NULL, 0);
    for (int s = 0; s < segs; s++) /* factor 1: no clip, no loss scale */
        adamw_update(pr + offsets[s], g + offsets[s], mr + offsets[s], vr + offsets[s],
                     (size_t)(offsets[s + 1] - offsets[s]), 0.01f, 0.9f, 0.95f, 1e-8f, wd[s], 3);
    assert_memory_equal(p, pr, sizeof p);
    for (int i = 0; i < n; i++) {
        assert_int_equal(m16[i], moe_bf16_round((float)mr[i]));
        assert_int_equal(v16[i], moe_bf16_round((float)vr[i]));
    }
}

/* sum_into adds to what is there, in the order of the calls. */
static void test_sum_into(void **state)
{
    (void)state;
    const real x[5] = {1.5f, -2.0f, 0.25f, 3.0f, -0.5f};
    double acc = 10.0;
    sum_into(&acc, x, 5, 0);
    assert_true(acc == 10.0 + 1.5 - 2.0 + 0.25 + 3.0 - 0.5);
    sum_into(&acc, x, 3, 1);
    assert_true(acc == 12.25 + 2.25 + 4.0 + 0.0625);
}

static void test_adamw_update(void **state)
{
    (void)state;
    enum { n = 4 };
    /* the hyperparameters as the kernel receives them (float), used in double below */
    const real lr = 0.01f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
    const real p0[n] = {1.0f, -0.5f, 0.25f, 2.0f}, g[n] = {0.1f, -0.2f, 0.3f, -0.05f};
    const real m0[n] = {0.01f, -0.02f, 0.0f, 0.03f}, v0[n] = {1e-4f, 2e-4f, 0.0f, 5e-5f};

    /* step 1 from zero moments: mhat = g, vhat = g^2, so p -= lr*wd*p + lr*g/(|g|+eps) */
    real p[n], m[n] = {0}, v[n] = {0};
    memcpy(p, p0, sizeof p);
    adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, 1);
    double want[n];
    for (int i = 0; i < n; i++)
        want[i] = p0[i] - (double)lr * wd * p0[i] - (double)lr * g[i] / (fabs(g[i]) + eps);
    assert_true(close_to("p (t=1)", p, want, n, 1e-7, 1e-6));

    /* step 3 from given moments */
    memcpy(p, p0, sizeof p);
    memcpy(m, m0, sizeof m);
    memcpy(v, v0, sizeof v);
    adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, 3);
    double want_m[n], want_v[n];
    for (int i = 0; i < n; i++) {
        double B1 = b1, B2 = b2;
        want_m[i] = B1 * m0[i] + (1 - B1) * g[i];
        want_v[i] = B2 * v0[i] + (1 - B2) * g[i] * g[i];
        double mhat = want_m[i] / (1 - B1 * B1 * B1), vhat = want_v[i] / (1 - B2 * B2 * B2);
        want[i] = p0[i] - (double)lr * wd * p0[i] - (double)lr * mhat / (sqrt(vhat) + eps);
    }
    assert_true(close_to("m", m, want_m, n, 1e-9, 1e-6));
    assert_true(close_to("v", v, want_v, n, 1e-12, 1e-6));
    assert_true(close_to("p (t=3)", p, want, n, 1e-7, 1e-6));
}

static void test_all_finite(void **state)
{
    (void)state;
    real x[6] = {1, -2, 3e38f, 1e-40f, 0, -0.0f};
    assert_int_equal(all_finite(x, 6), 1);
    assert_int_equal(all_finite(x, 0), 1);
    x[3] = NAN;
    assert_int_equal(all_finite(x, 6), 0);
    assert_int_equal(all_finite(x, 3), 1); /* only the first n count */
    x[3] = 1;
    x[0] = INFINITY;
    assert_int_equal(all_finite(x, 6), 0);
    x[0] = 1;
    x[5] = -INFINITY;
    assert_int_equal(all_finite(x, 6), 0);
}

static void test_small_forwards(void **state)
{
    (void)state;
    /* rmsnorm: x = (3, 4), mean square 12.5, eps 0.5 */
    const real x[2] = {3, 4}, wt[2] = {1, 2};
    real out[2], rstd[1];
    rmsnorm_forward(out, rstd, x, wt, 1, 2, 0.5f);
    const double r = 1 / sqrt(13.0), want_out[2] = {3 * r, 8 * r};
    assert_true(close_to("rmsnorm", out, want_out, 2, 1e-7, 1e-6));
    assert_true(close_to("rstd", rstd, &r, 1, 1e-7, 1e-6));

    /* swiglu: silu(1) * 2, silu(-2) * 0.5 */
    const real a[2] = {1, -2}, b[2] = {2, 0.5f};
    real h[2];
    swiglu_forward(h, a, b, 2);
    const double want_h[2] = {2 / (1 + exp(-1.0)), 0.5 * -2 / (1 + exp(2.0))};
    assert_true(close_to("swiglu", h, want_h, 2, 1e-7, 1e-6));

    /* embedding: rows of the table by token */
    const real table[3 * 2] = {1, 2, 3, 4, 5, 6};
    const int32_t tokens[3] = {2, 0, 2};
    real emb[3 * 2];
    embedding_forward(emb, tokens, table, 3, 2);
    const real want_emb[6] = {5, 6, 1, 2, 5, 6};
    assert_memory_equal(emb, want_emb, sizeof emb);

    /* add, scale, sum of squares */
    real y[3] = {1, 2, 3};
    const real z[3] = {0.5f, -1, 4};
    add_inplace(y, z, 3);
    scale_inplace(y, 2, 3);
    const real want_y[3] = {3, 2, 14};
    assert_memory_equal(y, want_y, sizeof y);
    assert_true(sum_squares(y, 3) == 9 + 4 + 196);
}

/* ---- matmul against a naive loop ------------------------------------------------ */

static void check_matmul_naive(int N, int I, int O)
{
    size_t nx = (size_t)N * I, nw = (size_t)O * I, no = (size_t)N * O;
    real *x = alloc_fill(nx, 10), *w = alloc_fill(nw, 11), *g = alloc_fill(no, 12);
    real *out = malloc(no * sizeof(real));
    real *dx = alloc_fill(nx, 13), *dw = alloc_fill(nw, 14);
    double *want_out = malloc(no * sizeof(double)), *want_dx = malloc(nx * sizeof(double)),
           *want_dw = malloc(nw * sizeof(double));
    for (int n = 0; n < N; n++)
        for (int o = 0; o < O; o++) {
            double s = 0;
            for (int i = 0; i < I; i++)
                s += (double)x[n * I + i] * w[o * I + i];
            want_out[n * O + o] = s;
        }
    for (int n = 0; n < N; n++)
        for (int i = 0; i < I; i++) {
            double s = dx[n * I + i];
            for (int o = 0; o < O; o++)
                s += (double)g[n * O + o] * w[o * I + i];
            want_dx[n * I + i] = s;
        }
    for (int o = 0; o < O; o++)
        for (int i = 0; i < I; i++) {
            double s = dw[o * I + i];
            for (int n = 0; n < N; n++)
                s += (double)g[n * O + o] * x[n * I + i];
            want_dw[o * I + i] = s;
        }
    matmul_forward(out, x, w, N, I, O);
    matmul_backward(dx, dw, g, x, w, N, I, O, 0);
    assert_true(close_to("out", out, want_out, no, 1e-5, 1e-5));
    assert_true(close_to("dx", dx, want_dx, nx, 1e-5, 1e-5));
    assert_true(close_to("dw", dw, want_dw, nw, 1e-5, 1e-5));
    /* the residual form: out = base + x W^T, into another buffer and in place */
    real *base = alloc_fill(no, 17), *outa = malloc(no * sizeof(real));
    real *inplace = malloc(no * sizeof(real));
    memcpy(inplace, base, no * sizeof(real));
    for (size_t i = 0; i < no; i++)
        want_out[i] += base[i];
    matmul_forward_add(outa, base, x, w, N, I, O);
    matmul_forward_add(inplace, inplace, x, w, N, I, O);
    assert_true(close_to("base + out", outa, want_out, no, 1e-5, 1e-5));
    assert_memory_equal(inplace, outa, no * sizeof(real));
    free(base), free(outa), free(inplace);
    free(x), free(w), free(g), free(out), free(dx), free(dw);
    free(want_out), free(want_dx), free(want_dw);
}

static void test_matmul_naive(void **state)
{
    (void)state;
    check_matmul_naive(7, 13, 5);
    check_matmul_naive(5, 41, 3);   /* full lanes of the dot product and a tail */
    check_matmul_naive(33, 70, 40); /* large enough to run on several threads */
}

static void test_grouped_matmul_naive(void **state)
{
    (void)state;
    enum { G = 3, M = 6, I = 7, O = 3 };
    const int offsets[G + 1] = {0, 2, 2, 6}; /* group 1 empty */
    real *x = alloc_fill(M * I, 15), *w = alloc_fill(G * O * I, 16);
    real out[M * O];
    double want[M * O];
    for (int g = 0; g < G; g++)
        for (int m = offsets[g]; m < offsets[g + 1]; m++)
            for (int o = 0; o < O; o++) {
                double s = 0;
                for (int i = 0; i < I; i++)
                    s += (double)x[m * I + i] * w[(g * O + o) * I + i];
                want[m * O + o] = s;
            }
    grouped_matmul_forward(out, x, w, offsets, G, I, O);
    assert_true(close_to("grouped out", out, want, M * O, 1e-5, 1e-5));
    free(x), free(w);
}

/* The pair ops against sums in double: outputs of both weights; in the backward dx gets
 * both products and dwa, dwb one each, all written over NaN (write flags), the empty
 * group's weight gradients zeroed. */
static void test_grouped_matmul_pair_naive(void **state)
{
    (void)state;
    enum { G = 3, M = 6, I = 5, O = 4 };
    const int offsets[G + 1] = {0, 3, 3, 6}; /* group 1 empty */
    real *x = alloc_fill(M * I, 31), *wa = alloc_fill(G * O * I, 32),
         *wb = alloc_fill(G * O * I, 33), *da = alloc_fill(M * O, 34), *db = alloc_fill(M * O, 35);
    real out[2][M * O], dx[M * I], dw[2][G * O * I];
    double want_out[2][M * O], want_dx[M * I] = {0}, want_dw[2][G * O * I] = {{0}};
    const real *ws[2] = {wa, wb}, *ds[2] = {da, db};
    for (int p = 0; p < 2; p++)
        for (int g = 0; g < G; g++)
            for (int m = offsets[g]; m < offsets[g + 1]; m++)
                for (int o = 0; o < O; o++) {
                    double s = 0;
                    for (int i = 0; i < I; i++) {
                        s += (double)x[m * I + i] * ws[p][(g * O + o) * I + i];
                        want_dx[m * I + i] += (double)ds[p][m * O + o] * ws[p][(g * O + o) * I + i];
                        want_dw[p][(g * O + o) * I + i] += (double)ds[p][m * O + o] * x[m * I + i];
                    }
                    want_out[p][m * O + o] = s;
                }
    grouped_matmul_forward_pair(out[0], out[1], x, wa, wb, offsets, G, I, O);
    assert_true(close_to("pair out a", out[0], want_out[0], M * O, 1e-5, 1e-5));
    assert_true(close_to("pair out b", out[1], want_out[1], M * O, 1e-5, 1e-5));
    /* with SwiGLU: h = silu(a) b of the products, in double, and the products, over NaN */
    real h[M * O];
    double want_h[M * O];
    for (int i = 0; i < M * O; i++) {
        const double a = want_out[0][i];
        want_h[i] = a / (1.0 + exp(-a)) * want_out[1][i];
        h[i] = out[0][i] = out[1][i] = NAN;
    }
    grouped_matmul_forward_pair_swiglu(h, out[0], out[1], x, wa, wb, offsets, G, I, O);
    assert_true(close_to("pair+swiglu h", h, want_h, M * O, 1e-5, 1e-5));
    assert_true(close_to("pair+swiglu out a", out[0], want_out[0], M * O, 1e-5, 1e-5));
    assert_true(close_to("pair+swiglu out b", out[1], want_out[1], M * O, 1e-5, 1e-5));
    for (int i = 0; i < M * I; i++)
        dx[i] = NAN;
    for (int i = 0; i < G * O * I; i++)
        dw[0][i] = dw[1][i] = NAN;
    grouped_matmul_backward_pair(dx, dw[0], dw[1], da, db, x, wa, wb, offsets, G, I, O,
                                 MOE_WRITE_DW | MOE_WRITE_DX);
    assert_true(close_to("pair dx", dx, want_dx, M * I, 1e-5, 1e-5));
    assert_true(close_to("pair dwa", dw[0], want_dw[0], G * O * I, 1e-5, 1e-5));
    assert_true(close_to("pair dwb", dw[1], want_dw[1], G * O * I, 1e-5, 1e-5));
    free(x), free(wa), free(wb), free(da), free(db);
}

/* ---- determinism across thread counts ------------------------------------------- */

typedef struct {
    real *out, *dx, *dw, *att, *lse, *dq, *dk, *dv, *rms, *rstd, *drx, *drw;
} det_result;

enum { DN = 64, DI = 96, DO = 80, DB = 2, DT = 32, DH = 4, DHd = 16, RN = 300, RD = 256 };

static void det_run(det_result *r, const real *x, const real *w, const real *g, const real *qkv,
                    const real *rx, const real *rw)
{
    size_t na = DB * DT * DH * DHd;
    r->out = malloc(DN * DO * sizeof(real));
    r->dx = copy_of(g, DN * DI); /* nonzero starts, the same for both runs */
    r->dw = copy_of(g, DO * DI);
    matmul_forward(r->out, x, w, DN, DI, DO);
    matmul_backward(r->dx, r->dw, g, x, w, DN, DI, DO, 0);

    const real *q = qkv, *k = qkv + na, *v = qkv + 2 * na;
    r->att = malloc(na * sizeof(real));
    r->lse = malloc(DB * DH * DT * sizeof(real));
    r->dq = copy_of(g, na), r->dk = copy_of(g, na), r->dv = copy_of(g, na);
    attention_forward(r->att, r->lse, q, k, v, DB, DT, DH, DHd);
    attention_backward(r->dq, r->dk, r->dv, g, r->att, r->lse, q, k, v, DB, DT, DH, DHd);

    r->rms = malloc(RN * RD * sizeof(real));
    r->rstd = malloc(RN * sizeof(real));
    r->drx = copy_of(g, RN * RD), r->drw = copy_of(g, RD);
    rmsnorm_forward(r->rms, r->rstd, rx, rw, RN, RD, 1e-5f);
    rmsnorm_backward(r->drx, r->drw, g, rx, rw, r->rstd, RN, RD, 0, NULL);
}

static void det_free(det_result *r)
{
    real **p = (real **)r;
    for (size_t i = 0; i < sizeof *r / sizeof(real *); i++)
        free(p[i]);
}

static void test_determinism_threads(void **state)
{
    (void)state;
    size_t na = DB * DT * DH * DHd;
    real *x = alloc_fill(DN * DI, 20), *w = alloc_fill(DO * DI, 21), *g = alloc_fill(RN * RD, 22);
    real *qkv = alloc_fill(3 * na, 23), *rx = alloc_fill(RN * RD, 24), *rw = alloc_fill(RD, 25);
    int saved = omp_get_max_threads();
    det_result r1, r2, r3;
    omp_set_num_threads(1);
    det_run(&r1, x, w, g, qkv, rx, rw);
    omp_set_num_threads(2);
    det_run(&r2, x, w, g, qkv, rx, rw);
    omp_set_num_threads(3);
    det_run(&r3, x, w, g, qkv, rx, rw);
    omp_set_num_threads(saved);
    const det_result *others[2] = {&r2, &r3};
    for (int j = 0; j < 2; j++) {
        const det_result *r = others[j];
        assert_memory_equal(r1.out, r->out, DN * DO * sizeof(real));
        assert_memory_equal(r1.dx, r->dx, DN * DI * sizeof(real));
        assert_memory_equal(r1.dw, r->dw, DO * DI * sizeof(real));
        assert_memory_equal(r1.att, r->att, na * sizeof(real));
        assert_memory_equal(r1.lse, r->lse, DB * DH * DT * sizeof(real));
        assert_memory_equal(r1.dq, r->dq, na * sizeof(real));
        assert_memory_equal(r1.dk, r->dk, na * sizeof(real));
        assert_memory_equal(r1.dv, r->dv, na * sizeof(real));
        assert_memory_equal(r1.rms, r->rms, RN * RD * sizeof(real));
        assert_memory_equal(r1.drx, r->drx, RN * RD * sizeof(real));
        assert_memory_equal(r1.drw, r->drw, RD * sizeof(real));
    }
    det_free(&r1), det_free(&r2), det_free(&r3);
    free(x), free(w), free(g), free(qkv), free(rx), free(rw);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_route_plan_dropless),
        cmocka_unit_test(test_pack_dispatch),
        cmocka_unit_test(test_scatter_grad_rows),
        cmocka_unit_test(test_half_rounding),
        cmocka_unit_test(test_route_plan_capacity),
        cmocka_unit_test(test_permute_combine_forward),
        cmocka_unit_test(test_router_forward),
        cmocka_unit_test(test_router_aux_partials),
        cmocka_unit_test(test_attention_causal),
        cmocka_unit_test(test_attention_t1),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention_backward_qkv),
        cmocka_unit_test(test_cross_entropy_forward),
        cmocka_unit_test(test_cross_entropy_backward),
        cmocka_unit_test(test_adamw_update),
        cmocka_unit_test(test_adamw_factor),
        cmocka_unit_test(test_adamw_update_multi),
        cmocka_unit_test(test_adamw_update_pieces),
        cmocka_unit_test(test_sum_into),
        cmocka_unit_test(test_bf16_round),
        cmocka_unit_test(test_adamw_bf16_moments),
        cmocka_unit_test(test_all_finite),
        cmocka_unit_test(test_small_forwards),
        cmocka_unit_test(test_matmul_naive),
        cmocka_unit_test(test_grouped_matmul_naive),
        cmocka_unit_test(test_grouped_matmul_pair_naive),
        cmocka_unit_test(test_determinism_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
