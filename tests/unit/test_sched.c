/* tests/unit/test_sched.c: sched/: routing statistics (counting, merge, file, printout),
 * the planner on synthetic routing traces with a planted structure (co-activated groups,
 * layer-to-layer chains, uniform and skewed loads), the cost model against exact counts,
 * determinism, and the plan and statistics files with each malformed-file error. Traces
 * come from util/rng.h, so every figure printed here is reproducible. Messages are read
 * back from stderr (fd 2 redirected to a file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sched/cost.h"
#include "sched/placement.h"
#include "sched/stats.h"
#include "util/rng.h"

#include "tmpdir.h"

static const char *tmp_path(const char *name)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    return path;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

/* The whole file as a string (caller frees). */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

#include "capture.h"

/* ---- synthetic traces ---- */

enum { STREAM_PERM = 1, STREAM_GROUP, STREAM_PICK, STREAM_NOISE, STREAM_CHAIN, STREAM_HOT };

typedef struct {
    int L, N, K, E;
    int32_t *idx; /* (L, N, K) */
    int32_t *src; /* (N): rank holding each token */
} trace;

static trace trace_new(int L, int N, int K, int E, int R)
{
    trace t = {L, N, K, E, calloc((size_t)L * N * K, sizeof(int32_t)), malloc(sizeof(int32_t) * N)};
    assert_non_null(t.idx);
    assert_non_null(t.src);
    for (int n = 0; n < N; n++)
        t.src[n] = n % R;
    return t;
}

static void trace_free(trace *t)
{
    free(t->idx);
    free(t->src);
}

static int32_t *tok(const trace *t, int l, int n) { return t->idx + ((size_t)l * t->N + n) * t->K; }

static int rnd_int(uint64_t seed, uint64_t stream, uint64_t i, int n)
{
    return (int)(moe_rng_u64(seed, stream, i) % (uint64_t)n);
}

/* A random permutation of 0..n-1 (Fisher-Yates on counters). */
static void permutation(int *perm, int n, uint64_t seed, uint64_t stream)
{
    for (int i = 0; i < n; i++)
        perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = rnd_int(seed, stream, (uint64_t)i, i + 1), x = perm[i];
        perm[i] = perm[j];
        perm[j] = x;
    }
}

/* Draws k distinct members of cand[0..n) for slot base of a token, weights w (NULL: equal),
 * by rejection on successive counters. */
static void draw_distinct(int32_t *out, int k, const int *cand, int n, const double *w,
                          uint64_t seed, uint64_t stream, uint64_t base)
{
    double total = 0;
    for (int i = 0; w && i < n; i++)
        total += w[i];
    uint64_t c = base * 1024;
    for (int j = 0; j < k;) {
        int pick;
        if (w) {
            double u = moe_rng_uniform(seed, stream, c++) * total, acc = 0;
            pick = n - 1;
            for (int i = 0; i < n; i++) {
                acc += w[i];
                if (u < acc) {
                    pick = i;
                    break;
                }
            }
        } else {
            pick = rnd_int(seed, stream, c++, n);
        }
        int dup = 0;
        for (int i = 0; i < j; i++)
            dup |= out[i] == cand[pick];
        if (!dup)
            out[j++] = cand[pick];
    }
}

static int *all_experts(int E)
{
    int *c = malloc(sizeof(int) * E);
    assert_non_null(c);
    for (int e = 0; e < E; e++)
        c[e] = e;
    return c;
}

/* Layer l of t: every token takes its K experts from one of E/gsize planted groups
 * (groups[g*gsize ...]), group g with weight gw[g] (NULL: equal); a share `noise` of the
 * tokens takes K experts uniformly instead. */
static void gen_groups(trace *t, int l, const int *groups, int gsize, const double *gw,
                       double noise, uint64_t seed)
{
    int G = t->E / gsize, *every = all_experts(t->E), *gidx = malloc(sizeof(int) * G);
    for (int g = 0; g < G; g++)
        gidx[g] = g;
    for (int n = 0; n < t->N; n++) {
        uint64_t id = (uint64_t)l * t->N + n;
        if (moe_rng_uniform(seed, STREAM_NOISE, id) < noise) {
            draw_distinct(tok(t, l, n), t->K, every, t->E, NULL, seed, STREAM_PICK, id);
            continue;
        }
        int32_t g;
        draw_distinct(&g, 1, gidx, G, gw, seed, STREAM_GROUP, id);
        draw_distinct(tok(t, l, n), t->K, groups + g * gsize, gsize, NULL, seed, STREAM_PICK, id);
    }
    free(every);
    free(gidx);
}

/* Layer l of t: K distinct experts per token, expert e with weight w[e] (NULL: equal). */
static void gen_uniform(trace *t, int l, const double *w, uint64_t seed)
{
    int *every = all_experts(t->E);
    for (int n = 0; n < t->N; n++)
        draw_distinct(tok(t, l, n), t->K, every, t->E, w, seed, STREAM_PICK,
                      (uint64_t)l * t->N + n);
    free(every);
}

/* Statistics of every layer of t, with transitions (added in chunks of `chunk` tokens). */
static moe_routing_stats *stats_of(const trace *t, int chunk)
{
    moe_routing_stats *s;
    assert_int_equal(moe_routing_stats_create(&s, t->L, t->E), MOE_OK);
    for (int l = 0; l < t->L; l++)
        for (int n0 = 0; n0 < t->N; n0 += chunk) {
            int n = t->N - n0 < chunk ? t->N - n0 : chunk;
            assert_int_equal(
                moe_routing_stats_add(s, l, tok(t, l, n0), l ? tok(t, l - 1, n0) : NULL, n, t->K),
                MOE_OK);
        }
    s->steps = 10;
    return s;
}

/* Exact traffic of all layers of t under p, with the tokens' source ranks. */
static moe_traffic trace_traffic(const moe_placement *p, const trace *t, int with_src)
{
    moe_traffic sum = {.exact = 1}, one;
    for (int l = 0; l < t->L; l++) {
        assert_int_equal(
            moe_cost_trace(p, l, tok(t, l, 0), with_src ? t->src : NULL, t->N, t->K, 512, &one),
            MOE_OK);
        moe_traffic_add(&sum, &one);
    }
    return sum;
}

static moe_placement *contiguous(int L, int E, int R, int G)
{
    moe_placement *p;
    assert_int_equal(moe_placement_create(&p, L, E, R, G), MOE_OK);
    return p;
}

static moe_placement *plan(const moe_routing_stats *s, int R, int G, const moe_plan_params *prm,
                           moe_plan_report *rep)
{
    moe_placement *p;
    assert_int_equal(moe_plan_experts(&p, s, R, G, prm, rep), MOE_OK);
    return p;
}

/* Every rank of layer l holds exactly one planted group (gsize = El). */
static void assert_groups_recovered(const moe_placement *p, int l, const int *groups)
{
    const int El = p->per_rank;
    for (int g = 0; g < p->experts / El; g++) {
        int r = p->expert_rank[(size_t)l * p->experts + groups[g * El]];
        for (int k = 1; k < El; k++)
            if (p->expert_rank[(size_t)l * p->experts + groups[g * El + k]] != r)
                fail_msg(
                    "layer %d: planted group %d split: expert %d on rank %d, expert %d on rank %d",
                    l, g, groups[g * El], r, groups[g * El + k],
                    p->expert_rank[(size_t)l * p->experts + groups[g * El + k]]);
    }
}

static void assert_balanced(const moe_placement *p, const moe_routing_stats *s, double bound)
{
    for (int l = 0; l < p->layers; l++) {
        double b = moe_placement_balance(p, s, l);
        if (b > bound + 1e-12)
            fail_msg("layer %d: max/mean rank load %.4f above the bound %.4f", l, b, bound);
    }
}

/* ---- statistics ---- */

static void test_stats_counts(void **state)
{
    (void)state;
    moe_routing_stats *s;
    assert_int_equal(moe_routing_stats_create(&s, 2, 4), MOE_OK);
    assert_int_equal(s->count, 2 + 2 * 4 + 2 * 16 + 1 * 16);
    assert_ptr_equal(s->tokens, s->data);
    assert_ptr_equal(s->trans + 16, s->data + s->count);
    /* layer 0: {0,1}, {2,-1}, {3,3} (repeat counts once), {-1,-1} (no expert) */
    const int32_t l0[] = {0, 1, 2, -1, 3, 3, -1, -1};
    const int32_t l1[] = {1, 2, 2, 3, 0, 1, 0, 3};
    assert_int_equal(moe_routing_stats_add(s, 0, l0, NULL, 4, 2), MOE_OK);
    assert_int_equal(moe_routing_stats_add(s, 1, l1, l0, 4, 2), MOE_OK);
    assert_int_equal(s->top_k, 2);
    assert_int_equal(s->tokens[0], 3);
    assert_int_equal(s->tokens[1], 4);
    const int64_t load0[] = {1, 1, 1, 1}, load1[] = {2, 2, 2, 2};
    assert_memory_equal(s->load, load0, sizeof load0);
    assert_memory_equal(s->load + 4, load1, sizeof load1);
    int64_t c0[16] = {0}, c1[16] = {0}, t0[16] = {0};
    c0[0 * 4 + 1] = c0[1 * 4 + 0] = 1;
    c1[1 * 4 + 2] = c1[2 * 4 + 1] = 1;
    c1[2 * 4 + 3] = c1[3 * 4 + 2] = 1;
    c1[0 * 4 + 1] = c1[1 * 4 + 0] = 1;
    c1[0 * 4 + 3] = c1[3 * 4 + 0] = 1;
    /* token 0: {0,1} -> {1,2}; token 1: {2} -> {2,3}; token 2: {3} -> {0,1}; token 3: none */
    t0[0 * 4 + 1] = t0[0 * 4 + 2] = t0[1 * 4 + 1] = t0[1 * 4 + 2] = 1;
    t0[2 * 4 + 2] = t0[2 * 4 + 3] = 1;
    t0[3 * 4 + 0] = t0[3 * 4 + 1] = 1;
    assert_memory_equal(s->coact, c0, sizeof c0);
    assert_memory_equal(s->coact + 16, c1, sizeof c1);
    assert_memory_equal(s->trans, t0, sizeof t0);

    /* errors count nothing */
    int64_t before[64];
    memcpy(before, s->data, sizeof(int64_t) * s->count);
    const int32_t bad[] = {0, 1, 1, 4};
    capture_begin();
    assert_int_equal(moe_routing_stats_add(s, 1, bad, NULL, 2, 2), MOE_ERR_INVALID);
    assert_int_equal(moe_routing_stats_add(s, 0, l0, l0, 4, 2), MOE_ERR_INVALID);
    assert_int_equal(moe_routing_stats_add(s, 0, l0, NULL, 2, 4), MOE_ERR_INVALID);
    assert_int_equal(moe_routing_stats_add(s, 2, l0, NULL, 4, 2), MOE_ERR_INVALID);
    assert_int_equal(moe_routing_stats_add(s, 1, l1, bad, 2, 2), MOE_ERR_INVALID);
    const char *msg = capture_end();
    assert_has(msg, "id 4 of token 1 (slot 1) is not below E = 4");
    assert_has(msg, "layer 0 has no previous MoE layer");
    assert_has(msg, "trace has K = 4, earlier traces K = 2");
    assert_has(msg, "layer 2 out of range [0, 2)");
    assert_has(msg, "previous-layer expert id 4");
    assert_memory_equal(s->data, before, sizeof(int64_t) * s->count);

    moe_routing_stats_reset(s);
    for (size_t i = 0; i < s->count; i++)
        assert_int_equal(s->data[i], 0);
    assert_int_equal(s->top_k, 0);
    moe_routing_stats_destroy(s);
    moe_routing_stats_destroy(NULL);

    capture_begin();
    assert_int_equal(moe_routing_stats_create(&s, 0, 4), MOE_ERR_INVALID);
    assert_null(s);
    capture_end();
}

/* Merging the statistics of two halves of the tokens (as two ranks would), or summing
 * their blocks (as an allreduce would), gives those of all the tokens. */
static void test_stats_merge(void **state)
{
    (void)state;
    trace t = trace_new(3, 1000, 2, 8, 2);
    for (int l = 0; l < 3; l++)
        gen_uniform(&t, l, NULL, 7);
    moe_routing_stats *all = stats_of(&t, 1000), *a, *b, *c;
    assert_int_equal(moe_routing_stats_create(&a, 3, 8), MOE_OK);
    assert_int_equal(moe_routing_stats_create(&b, 3, 8), MOE_OK);
    for (int l = 0; l < 3; l++) {
        assert_int_equal(
            moe_routing_stats_add(a, l, tok(&t, l, 0), l ? tok(&t, l - 1, 0) : NULL, 300, 2),
            MOE_OK);
        assert_int_equal(
            moe_routing_stats_add(b, l, tok(&t, l, 300), l ? tok(&t, l - 1, 300) : NULL, 700, 2),
            MOE_OK);
    }
    a->steps = b->steps = 10;
    assert_int_equal(moe_routing_stats_merge(a, b), MOE_OK);
    assert_int_equal(a->steps, 10);
    assert_memory_equal(a->data, all->data, sizeof(int64_t) * all->count);

    /* an allreduce (sum) of the two blocks: the same */
    moe_routing_stats_reset(a);
    for (int l = 0; l < 3; l++)
        assert_int_equal(
            moe_routing_stats_add(a, l, tok(&t, l, 0), l ? tok(&t, l - 1, 0) : NULL, 300, 2),
            MOE_OK);
    int64_t *sum = calloc(all->count, sizeof(int64_t));
    assert_non_null(sum);
    for (size_t i = 0; i < all->count; i++)
        sum[i] = a->data[i] + b->data[i];
    assert_memory_equal(sum, all->data, sizeof(int64_t) * all->count);
    free(sum);

    assert_int_equal(moe_routing_stats_create(&c, 2, 8), MOE_OK);
    capture_begin();
    assert_int_equal(moe_routing_stats_merge(c, a), MOE_ERR_INVALID);
    const char *msg = capture_end();
    assert_has(msg, "cannot merge 3 layers x 8 experts into 2 x 8");
    moe_routing_stats_destroy(a);
    moe_routing_stats_destroy(b);
    moe_routing_stats_destroy(c);
    moe_routing_stats_destroy(all);
    trace_free(&t);
}

static void test_stats_print(void **state)
{
    (void)state;
    moe_routing_stats *s;
    assert_int_equal(moe_routing_stats_create(&s, 2, 4), MOE_OK);
    const int32_t l0[] = {0, 1, 0, 1, 2, 3}, l1[] = {3, 2, 3, 2, 0, 1};
    assert_int_equal(moe_routing_stats_add(s, 0, l0, NULL, 3, 2), MOE_OK);
    assert_int_equal(moe_routing_stats_add(s, 1, l1, l0, 3, 2), MOE_OK);
    s->steps = 5;
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(moe_routing_stats_print(s, f, 2), MOE_OK);
    rewind(f);
    char buf[2048];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    printf("%s", buf);
    assert_has(buf, "routing statistics: 2 MoE layers, 4 experts, top-2, 5 steps");
    assert_has(buf,
               "layer 0: 3 tokens, 6 assignments; expert load min 1 max 2 mean 1.5 max/mean 1.33");
    assert_has(buf, "co-activated pairs (share of tokens): 0+1 66.7% 2+3 33.3%");
    assert_has(buf, "transitions to layer 1 (share of tokens): 0->2 66.7% 0->3 66.7%");
    moe_routing_stats_destroy(s);
}

/* ---- (a) planted groups ---- */

static void test_planted_groups_top2(void **state)
{
    (void)state;
    const int E = 16, R = 4, G = 2, K = 2, N = 4000;
    int groups[16];
    permutation(groups, E, 11, STREAM_PERM); /* group g = groups[4g..4g+3]: shuffled ids */
    trace t = trace_new(1, N, K, E, R);
    gen_groups(&t, 0, groups, 4, NULL, 0.05, 11);
    moe_routing_stats *s = stats_of(&t, 512);
    moe_plan_report rep;
    moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(1, E, R, G);
    assert_groups_recovered(p, 0, groups);
    assert_balanced(p, s, 1.1);
    assert_int_equal(rep.layers_relaxed, 0);

    moe_traffic tp = trace_traffic(p, &t, 1), tc = trace_traffic(c, &t, 1);
    double cross_p = moe_traffic_cross_rank(&tp), cross_c = moe_traffic_cross_rank(&tc);
    printf("  planted groups, top-2: rows %.0f -> %.0f; cross-rank bytes %.0f -> %.0f (%.2fx); "
           "rows beyond one per token %.0f -> %.0f (%.1fx); balance %.3f\n",
           tc.rows, tp.rows, cross_c, cross_p, cross_c / cross_p, tc.rows - tc.tokens,
           tp.rows - tp.tokens, (tc.rows - tc.tokens) / (tp.rows - tp.tokens), rep.worst_balance);
    moe_traffic_print(stdout, "  contiguous", &tc, NULL);
    moe_traffic_print(stdout, "  planned   ", &tp, &tc);
    /* top-2 can at best halve the rows (two rows -> one); the planted structure nearly does */
    assert_true(cross_c / cross_p >= 1.6);
    assert_true((tc.rows - tc.tokens) >= 10 * (tp.rows - tp.tokens));

    /* the model from statistics is exact at top-2 and agrees with the trace (expected
     * over the source rank); with the real source ranks the split is close to it */
    moe_traffic ep, xp = trace_traffic(p, &t, 0);
    assert_int_equal(moe_cost_stats(p, s, -1, 512, &ep), MOE_OK);
    assert_true(ep.exact);
    assert_true(fabs(ep.rows - xp.rows) < 1e-6 && ep.rows_upper == ep.rows);
    assert_true(fabs(ep.node_rows - xp.node_rows) < 1e-6);
    assert_true(fabs(ep.bytes_remote - xp.bytes_remote) < 1e-3);
    assert_true(fabs(ep.bytes_saved - xp.bytes_saved) < 1e-3);
    assert_true(fabs(moe_traffic_cross_rank(&ep) - cross_p) < 0.02 * cross_p);

    /* each half of the planner alone finds the groups: the greedy grouping without any
     * swap, and the swaps from the contiguous placement (a re-plan from the current one) */
    moe_plan_params prm = moe_plan_params_default();
    prm.max_moves = -1;
    moe_placement *g = plan(s, R, G, &prm, &rep);
    assert_int_equal(rep.moves, 0);
    assert_groups_recovered(g, 0, groups);
    moe_plan_report rr;
    assert_int_equal(moe_placement_refine(c, s, NULL, &rr), MOE_OK);
    printf("  refined from contiguous: %lld swaps, objective %.0f -> %.0f (planned %.0f)\n",
           (long long)rr.moves, rr.objective_contiguous[0], rr.objective[0], rep.objective[0]);
    assert_groups_recovered(c, 0, groups);
    assert_balanced(c, s, 1.1);
    assert_true(rr.moves > 0 && rr.objective[0] > rr.objective_contiguous[0]);
    moe_placement_destroy(g);
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* Top-4 from groups of 4 on 8 ranks: a token's whole group on one rank. Also the
 * estimate for k > 2 against exact counts. */
static void test_planted_groups_top4(void **state)
{
    (void)state;
    const int E = 32, R = 8, G = 4, K = 4, N = 4000;
    int groups[32];
    permutation(groups, E, 23, STREAM_PERM);
    trace t = trace_new(1, N, K, E, R);
    gen_groups(&t, 0, groups, 4, NULL, 0.05, 23);
    moe_routing_stats *s = stats_of(&t, 4000);
    moe_plan_report rep;
    moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(1, E, R, G);
    assert_groups_recovered(p, 0, groups);
    assert_balanced(p, s, 1.1);
    moe_traffic tp = trace_traffic(p, &t, 1), tc = trace_traffic(c, &t, 1);
    double f = moe_traffic_cross_rank(&tc) / moe_traffic_cross_rank(&tp);
    printf("  planted groups, top-4: rows %.0f -> %.0f, cross-rank bytes %.3gx fewer, node rows "
           "%.0f -> %.0f, balance %.3f\n",
           tc.rows, tp.rows, f, tc.node_rows, tp.node_rows, rep.worst_balance);
    assert_true(f >= 2.5);

    /* the estimate from statistics brackets the exact rows */
    for (int which = 0; which < 2; which++) {
        const moe_placement *q = which ? c : p;
        moe_traffic est, ex = trace_traffic(q, &t, 0);
        assert_int_equal(moe_cost_stats(q, s, 0, 512, &est), MOE_OK);
        assert_false(est.exact);
        printf("  top-4 %s: rows exact %.0f, estimate %.1f .. %.1f (%+.2f%% .. %+.2f%%); node rows "
               "%.0f, %.1f .. %.1f\n",
               which ? "contiguous" : "planned", ex.rows, est.rows, est.rows_upper,
               100.0 * (est.rows - ex.rows) / ex.rows, 100.0 * (est.rows_upper - ex.rows) / ex.rows,
               ex.node_rows, est.node_rows, est.node_rows_upper);
        assert_true(est.rows <= ex.rows + 1e-6 && ex.rows <= est.rows_upper + 1e-6);
        assert_true(est.node_rows <= ex.node_rows + 1e-6 &&
                    ex.node_rows <= est.node_rows_upper + 1e-6);
        assert_true(est.rows >= 0.9 * ex.rows && est.rows_upper <= 1.15 * ex.rows);
    }
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* A production-like size: 256 experts on 32 ranks (8 per rank) of 4 nodes, two layers,
 * groups of 8. Checks recovery and that planning stays fast. */
static void test_planted_groups_large(void **state)
{
    (void)state;
    const int L = 2, E = 256, R = 32, G = 8, K = 2, N = 40000;
    int *groups = malloc(sizeof(int) * E * L);
    assert_non_null(groups);
    trace t = trace_new(L, N, K, E, R);
    for (int l = 0; l < L; l++) {
        permutation(groups + l * E, E, 83 + l, STREAM_PERM);
        gen_groups(&t, l, groups + l * E, 8, NULL, 0.05, 83 + l);
    }
    moe_routing_stats *s = stats_of(&t, 4096);
    moe_plan_report rep;
    moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(L, E, R, G);
    for (int l = 0; l < L; l++)
        assert_groups_recovered(p, l, groups + l * E);
    assert_balanced(p, s, 1.1);
    moe_traffic tp = trace_traffic(p, &t, 1), tc = trace_traffic(c, &t, 1);
    printf("  planted groups, E 256 R 32: rows %.0f -> %.0f, cross-rank bytes %.2fx fewer, "
           "balance %.3f, moves %lld\n",
           tc.rows, tp.rows, moe_traffic_cross_rank(&tc) / moe_traffic_cross_rank(&tp),
           rep.worst_balance, (long long)rep.moves);
    assert_true(moe_traffic_cross_rank(&tc) >= 1.6 * moe_traffic_cross_rank(&tp));
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
    free(groups);
}

/* Two levels: groups of 4 (one rank) inside pairs of groups (one node of 2 ranks). A token
 * takes both experts from its group (70%), one from its group and one from the sibling
 * group (25%), or two at random (5%). The plan keeps groups on ranks and siblings on a
 * node; so do the swaps alone from the contiguous placement (whole ranks change nodes). */
static void test_node_level(void **state)
{
    (void)state;
    const int E = 16, R = 4, G = 2, N = 6000;
    int groups[16], *every = all_experts(E);
    permutation(groups, E, 97, STREAM_PERM);
    trace t = trace_new(1, N, 2, E, R);
    for (int n = 0; n < N; n++) {
        int32_t *x = tok(&t, 0, n);
        double u = moe_rng_uniform(97, STREAM_NOISE, (uint64_t)n);
        int g = rnd_int(97, STREAM_GROUP, (uint64_t)n, 4), sib = g ^ 1;
        if (u < 0.70) {
            draw_distinct(x, 2, groups + 4 * g, 4, NULL, 97, STREAM_PICK, (uint64_t)n);
        } else if (u < 0.95) {
            draw_distinct(&x[0], 1, groups + 4 * g, 4, NULL, 97, STREAM_PICK, (uint64_t)n);
            draw_distinct(&x[1], 1, groups + 4 * sib, 4, NULL, 97, STREAM_HOT, (uint64_t)n);
        } else {
            draw_distinct(x, 2, every, E, NULL, 97, STREAM_PICK, (uint64_t)n);
        }
    }
    free(every);
    moe_routing_stats *s = stats_of(&t, N);
    moe_placement *p = plan(s, R, G, NULL, NULL), *c = contiguous(1, E, R, G);
    moe_traffic tc = trace_traffic(c, &t, 1);
    moe_plan_report rr;
    assert_int_equal(moe_placement_refine(c, s, NULL, &rr), MOE_OK);
    for (int which = 0; which < 2; which++) {
        const moe_placement *q = which ? c : p;
        assert_groups_recovered(q, 0, groups);
        for (int g = 0; g < 4; g += 2)
            assert_int_equal(q->expert_rank[groups[4 * g]] / G,
                             q->expert_rank[groups[4 * g + 4]] / G);
        moe_traffic tq = trace_traffic(q, &t, 1);
        printf("  two levels, %s: rows %.0f -> %.0f, node rows %.0f -> %.0f, remote bytes %.3g -> "
               "%.3g\n",
               which ? "refined from contiguous" : "planned", tc.rows, tq.rows, tc.node_rows,
               tq.node_rows, tc.bytes_remote, tq.bytes_remote);
        assert_true(tq.node_rows < 0.75 * tc.node_rows);
    }
    assert_true(moe_placement_equal(p, c) || rr.objective[1] > rr.objective_contiguous[1]);
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* ---- (b) chains ---- */

/* Layer 0 uniform; in layer l+1 a token's first expert is pi_l(its first expert in layer
 * l) with probability 0.9, its second uniform: the co-activation of layer l+1 carries no
 * structure, only the transitions do. */
static void gen_chains(trace *t, int *pi, uint64_t seed)
{
    int *every = all_experts(t->E);
    gen_uniform(t, 0, NULL, seed);
    for (int l = 0; l + 1 < t->L; l++) {
        permutation(pi + l * t->E, t->E, seed + l, STREAM_CHAIN);
        for (int n = 0; n < t->N; n++) {
            uint64_t id = (uint64_t)(l + 1) * t->N + n;
            int32_t *x = tok(t, l + 1, n);
            if (moe_rng_uniform(seed, STREAM_NOISE, id) < 0.9) {
                x[0] = pi[l * t->E + tok(t, l, n)[0]];
                do
                    draw_distinct(&x[1], 1, every, t->E, NULL, seed, STREAM_PICK, id++ * 7);
                while (x[1] == x[0]);
            } else {
                draw_distinct(x, 2, every, t->E, NULL, seed, STREAM_PICK, id);
            }
        }
    }
    free(every);
}

/* How many experts i of layer l have pi_l(i) on their rank in layer l+1. */
static int chains_kept(const moe_placement *p, const int *pi, int l)
{
    const int E = p->experts;
    int kept = 0;
    for (int i = 0; i < E; i++)
        kept += p->expert_rank[(size_t)l * E + i] ==
                p->expert_rank[(size_t)(l + 1) * E + pi[l * E + i]];
    return kept;
}

static void test_chains(void **state)
{
    (void)state;
    const int L = 3, E = 16, R = 4, G = 2, N = 4000;
    int pi[2 * 16];
    trace t = trace_new(L, N, 2, E, R);
    gen_chains(&t, pi, 31);
    moe_routing_stats *s = stats_of(&t, 1000);
    moe_plan_report rep;
    moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(L, E, R, G);
    assert_balanced(p, s, 1.1);
    moe_traffic sp, sc;
    assert_int_equal(moe_cost_stats(p, s, -1, 512, &sp), MOE_OK);
    assert_int_equal(moe_cost_stats(c, s, -1, 512, &sc), MOE_OK);
    printf("  chains: kept %d/16 and %d/16; transitions on one rank %.1f%% (contiguous %.1f%%); "
           "sweeps %d, moves %lld\n",
           chains_kept(p, pi, 0), chains_kept(p, pi, 1), 100 * sp.transitions_rank / sp.transitions,
           100 * sc.transitions_rank / sc.transitions, rep.sweeps, (long long)rep.moves);
    assert_int_equal(chains_kept(p, pi, 0), E);
    assert_int_equal(chains_kept(p, pi, 1), E);
    /* the chained pair is one of a token's four transition pairs: about 42% at most */
    assert_true(sp.transitions_rank > 1.5 * sc.transitions_rank);
    double oc[2];
    assert_int_equal(moe_placement_objective(c, s, NULL, oc), MOE_OK);
    assert_true(rep.objective[0] >= oc[0]);
    assert_true(rep.objective_contiguous[0] == oc[0]);

    /* without the transition term the layers are planned apart: the chains are not kept */
    moe_plan_params prm = moe_plan_params_default();
    prm.transition_weight = 0;
    moe_placement *q = plan(s, R, G, &prm, NULL);
    printf("  chains without the transition term: kept %d/16 and %d/16\n", chains_kept(q, pi, 0),
           chains_kept(q, pi, 1));
    assert_true(chains_kept(q, pi, 0) < E / 2 && chains_kept(q, pi, 1) < E / 2);
    moe_placement_destroy(q);
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* ---- (c) uniform traces ---- */

static void test_uniform_never_worse(void **state)
{
    (void)state;
    static const struct {
        int L, E, R, G, K;
    } cases[] = {{2, 16, 4, 2, 2}, {2, 32, 8, 4, 4}, {1, 64, 8, 2, 2}, {3, 8, 4, 4, 2}};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (uint64_t seed = 1; seed <= 3; seed++) {
            int L = cases[ci].L, E = cases[ci].E, R = cases[ci].R, G = cases[ci].G, K = cases[ci].K;
            trace t = trace_new(L, 3000, K, E, R);
            for (int l = 0; l < L; l++)
                gen_uniform(&t, l, NULL, 100 * ci + seed);
            moe_routing_stats *s = stats_of(&t, 3000);
            moe_plan_report rep;
            moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(L, E, R, G);
            moe_traffic tp = trace_traffic(p, &t, 1), tc = trace_traffic(c, &t, 1);
            double op[2], oc[2];
            assert_int_equal(moe_placement_objective(p, s, NULL, op), MOE_OK);
            assert_int_equal(moe_placement_objective(c, s, NULL, oc), MOE_OK);
            printf("  uniform L%d E%d R%d G%d K%d seed %d: rows %.0f -> %.0f (%+.2f%%), node rows "
                   "%.0f -> %.0f, balance %.3f\n",
                   L, E, R, G, K, (int)seed, tc.rows, tp.rows, 100 * (tp.rows - tc.rows) / tc.rows,
                   tc.node_rows, tp.node_rows, rep.worst_balance);
            assert_true(op[0] >= oc[0]);
            assert_true(tp.rows <= tc.rows);
            /* without swaps too: the contiguous placement is one of the starts */
            moe_plan_params prm = moe_plan_params_default();
            prm.max_moves = -1;
            moe_placement *q = plan(s, R, G, &prm, &rep);
            assert_true(rep.objective[0] >= rep.objective_contiguous[0]);
            printf("    without swaps: objective %.0f, contiguous %.0f, with swaps %.0f\n",
                   rep.objective[0], rep.objective_contiguous[0], op[0]);
            moe_placement_destroy(q);
            assert_true(moe_traffic_cross_rank(&tp) <= moe_traffic_cross_rank(&tc) * 1.02);
            assert_balanced(p, s, 1.1);
            assert_int_equal(rep.layers_relaxed, 0);
            moe_placement_destroy(p);
            moe_placement_destroy(c);
            moe_routing_stats_destroy(s);
            trace_free(&t);
        }
}

/* ---- (d) skewed loads ---- */

static void test_skewed_balance(void **state)
{
    (void)state;
    const int E = 16, R = 4, G = 2, N = 6000;
    /* four random experts three times as hot */
    double w[16];
    int hot[16];
    permutation(hot, E, 41, STREAM_HOT);
    for (int e = 0; e < E; e++)
        w[e] = 1.0;
    for (int k = 0; k < 4; k++)
        w[hot[k]] = 3.0;
    trace t = trace_new(2, N, 2, E, R);
    gen_uniform(&t, 0, w, 41);
    gen_uniform(&t, 1, w, 42);
    moe_routing_stats *s = stats_of(&t, N);
    moe_plan_report rep;
    moe_placement *p = plan(s, R, G, NULL, &rep), *c = contiguous(2, E, R, G);
    printf("  hot experts: balance contiguous %.3f / %.3f, planned %.3f / %.3f (bound 1.1)\n",
           moe_placement_balance(c, s, 0), moe_placement_balance(c, s, 1),
           moe_placement_balance(p, s, 0), moe_placement_balance(p, s, 1));
    assert_balanced(p, s, 1.1);
    assert_int_equal(rep.layers_relaxed, 0);
    assert_true(rep.worst_balance <= 1.1 + 1e-12);
    moe_placement_destroy(p);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);

    /* planted groups, one group three times as frequent. Keeping it on one rank would give
     * max/mean 2.0; at slack 0.1 every rank takes one hot expert and three cold ones, and
     * the best is three ranks each with three experts of one cold group (9 of the 18 cold
     * pairs, no hot pair). At slack 0.5 two ranks may take two hot experts each, and the
     * two other ranks two whole cold groups: more pairs kept, fewer rows. */
    int groups[16];
    permutation(groups, E, 43, STREAM_PERM);
    const double gw[4] = {3, 1, 1, 1};
    t = trace_new(1, N, 2, E, R);
    gen_groups(&t, 0, groups, 4, gw, 0.05, 43);
    s = stats_of(&t, N);
    c = contiguous(1, E, R, G);
    moe_traffic tc = trace_traffic(c, &t, 1), tp[2];
    for (int i = 0; i < 2; i++) {
        moe_plan_params prm = moe_plan_params_default();
        prm.slack = i ? 0.5 : 0.1;
        p = plan(s, R, G, &prm, &rep);
        tp[i] = trace_traffic(p, &t, 1);
        int kept[4] = {0};
        for (int g = 0; g < 4; g++)
            for (int a = 0; a < 4; a++)
                for (int b = a + 1; b < 4; b++)
                    kept[g] +=
                        p->expert_rank[groups[g * 4 + a]] == p->expert_rank[groups[g * 4 + b]];
        printf("  hot group, slack %.1f: balance %.3f, planted pairs kept: hot %d/6, cold %d/18; "
               "rows %.0f -> %.0f\n",
               prm.slack, rep.worst_balance, kept[0], kept[1] + kept[2] + kept[3], tc.rows,
               tp[i].rows);
        assert_balanced(p, s, 1.0 + prm.slack);
        assert_int_equal(rep.layers_relaxed, 0);
        assert_true(tp[i].rows < tc.rows);
        if (i == 0) {
            assert_int_equal(kept[0], 0);
            assert_int_equal(kept[1] + kept[2] + kept[3], 9);
        } else {
            assert_int_equal(kept[0], 2);
            assert_int_equal(kept[1] + kept[2] + kept[3], 14);
        }
        moe_placement_destroy(p);
    }
    assert_true(tp[1].rows < tp[0].rows);
    moe_placement_destroy(c);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* One expert alone heavier than the bound: the bound relaxes to the best balance the
 * balance-only heuristic finds (here the optimum: the hot expert with the lightest). */
static void test_infeasible_bound(void **state)
{
    (void)state;
    const int E = 8, R = 4;
    moe_routing_stats *s;
    assert_int_equal(moe_routing_stats_create(&s, 1, E), MOE_OK);
    int64_t counts[8] = {1000, 100, 101, 102, 103, 104, 105, 106}, sum = 0;
    for (int e = 0; e < E; e++) {
        int32_t id = e;
        for (int64_t i = 0; i < counts[e]; i++)
            assert_int_equal(moe_routing_stats_add(s, 0, &id, NULL, 1, 1), MOE_OK);
        sum += counts[e];
    }
    moe_plan_report rep;
    moe_placement *p = plan(s, R, 2, NULL, &rep);
    double best = (double)(1000 + 100) * R / (double)sum;
    printf("  infeasible bound: balance %.4f, bound used %.4f, best possible %.4f\n",
           rep.worst_balance, rep.worst_bound, best);
    assert_int_equal(rep.layers_relaxed, 1);
    assert_true(fabs(rep.worst_balance - best) < 1e-12);
    assert_true(fabs(rep.worst_bound - best) < 1e-12);
    assert_int_equal(p->expert_rank[1], p->expert_rank[0]);
    moe_placement_destroy(p);
    moe_routing_stats_destroy(s);
}

/* ---- (e) determinism ---- */

static void test_deterministic(void **state)
{
    (void)state;
    const int E = 32, R = 8, G = 4;
    int pi[2 * 32];
    trace t = trace_new(3, 3000, 2, E, R);
    gen_chains(&t, pi, 57);
    moe_routing_stats *a = stats_of(&t, 3000), *b = stats_of(&t, 77);
    assert_memory_equal(a->data, b->data, sizeof(int64_t) * a->count);
    moe_plan_report ra, rb;
    moe_placement *pa = plan(a, R, G, NULL, &ra), *pb = plan(b, R, G, NULL, &rb),
                  *pc = plan(a, R, G, NULL, NULL);
    assert_true(moe_placement_equal(pa, pb));
    assert_true(moe_placement_equal(pa, pc));
    assert_int_equal(ra.moves, rb.moves);
    assert_int_equal(ra.sweeps, rb.sweeps);
    assert_true(ra.objective[0] == rb.objective[0] && ra.objective[1] == rb.objective[1]);
    assert_true(ra.worst_balance == rb.worst_balance);

    /* through the statistics file: the same plan */
    moe_routing_stats *c;
    assert_int_equal(moe_routing_stats_save(a, tmp_path("det.stats")), MOE_OK);
    assert_int_equal(moe_routing_stats_load(&c, tmp_path("det.stats")), MOE_OK);
    moe_placement *pd = plan(c, R, G, NULL, NULL);
    assert_true(moe_placement_equal(pa, pd));
    /* and the plan differs from contiguous (so equality above means something) */
    moe_placement *cont = contiguous(3, E, R, G);
    assert_false(moe_placement_equal(pa, cont));
    for (int l = 0; l < 3; l++) /* the inverse tables agree */
        for (int e = 0; e < E; e++) {
            int r = pa->expert_rank[l * E + e], k = pa->expert_local[l * E + e];
            assert_int_equal(pa->rank_experts[(l * R + r) * pa->per_rank + k], e);
            assert_true(k == 0 || pa->rank_experts[(l * R + r) * pa->per_rank + k - 1] < e);
        }
    moe_placement_destroy(pa);
    moe_placement_destroy(pb);
    moe_placement_destroy(pc);
    moe_placement_destroy(pd);
    moe_placement_destroy(cont);
    moe_routing_stats_destroy(a);
    moe_routing_stats_destroy(b);
    moe_routing_stats_destroy(c);
    trace_free(&t);
}

/* ---- the cost model by hand, and the placement table ---- */

static void test_cost_by_hand(void **state)
{
    (void)state;
    /* E 4, R 2, one rank per node: {0,1} on rank 0, {2,3} on rank 1 */
    moe_placement *p = contiguous(1, 4, 2, 1);
    const int32_t idx[] = {0, 1, 0, 2, 2, 3, 1, -1, 3, 3};
    const int32_t src[] = {0, 0, 0, 1, 1};
    moe_traffic t;
    assert_int_equal(moe_cost_trace(p, 0, idx, src, 5, 2, 100, &t), MOE_OK);
    /* token 0 {0,1}@0: one row, own rank, saves 0 (own); token 1 {0,2}@0: rank 0 own, rank 1
     * remote; token 2 {2,3}@0: one remote row, saves one; token 3 {1}@1: remote; token 4
     * {3}@1: own */
    assert_true(t.tokens == 5 && t.assignments == 8 && t.rows == 6 && t.node_rows == 6);
    assert_true(t.bytes_rank == 300 && t.bytes_node == 0 && t.bytes_remote == 300);
    assert_true(t.bytes_saved == 100);
    assert_true(t.exact);
    /* expected over the source: half of the 6 rows stay on their rank; of the 2 rows saved
     * by sending a token once, half would have gone to the other rank */
    assert_int_equal(moe_cost_trace(p, 0, idx, NULL, 5, 2, 100, &t), MOE_OK);
    assert_true(t.bytes_rank == 300 && t.bytes_remote == 300 && t.bytes_saved == 100);

    moe_routing_stats *s;
    assert_int_equal(moe_routing_stats_create(&s, 1, 4), MOE_OK);
    assert_int_equal(moe_routing_stats_add(s, 0, idx, NULL, 5, 2), MOE_OK);
    assert_int_equal(moe_cost_stats(p, s, 0, 100, &t), MOE_OK);
    assert_true(t.rows == 6 && t.node_rows == 6 && t.exact);

    capture_begin();
    const int32_t bad_src[] = {0, 0, 0, 2, 1};
    assert_int_equal(moe_cost_trace(p, 0, idx, bad_src, 5, 2, 100, &t), MOE_ERR_INVALID);
    const char *msg = capture_end();
    assert_has(msg, "source rank 2 of token 3 is not in [0, 2)");

    /* the table */
    const int good[] = {1, 0, 0, 1}, bad[] = {1, 1, 1, 0}, out_of_range[] = {0, 2, 1, 1};
    assert_int_equal(moe_placement_set_layer(p, 0, good), MOE_OK);
    assert_int_equal(p->rank_experts[0], 1);
    assert_int_equal(p->rank_experts[1], 2);
    assert_int_equal(p->expert_local[3], 1);
    capture_begin();
    assert_int_equal(moe_placement_set_layer(p, 0, bad), MOE_ERR_INVALID);
    assert_int_equal(moe_placement_set_layer(p, 0, out_of_range), MOE_ERR_INVALID);
    moe_placement *q;
    assert_int_equal(moe_placement_create(&q, 1, 6, 4, 1), MOE_ERR_INVALID);
    assert_null(q);
    assert_int_equal(moe_placement_create(&q, 1, 8, 4, 3), MOE_ERR_INVALID);
    msg = capture_end();
    assert_has(msg, "layer 0: rank 0 gets 1 experts, expected 2");
    assert_has(msg, "layer 0: expert 1 on rank 2, not in [0, 2)");
    assert_has(msg, "4 ranks must divide 6 experts");
    assert_has(msg, "3 ranks per node must divide 4 ranks");
    assert_int_equal(p->expert_rank[0], 1); /* unchanged by the failures */
    moe_placement_destroy(p);
    moe_placement_destroy(NULL);
    moe_routing_stats_destroy(s);
}

/* ---- (f) the plan file ---- */

static void test_plan_file(void **state)
{
    (void)state;
    int groups[16];
    permutation(groups, 16, 61, STREAM_PERM);
    trace t = trace_new(2, 2000, 2, 16, 4);
    gen_groups(&t, 0, groups, 4, NULL, 0.05, 61);
    gen_groups(&t, 1, groups, 4, NULL, 0.05, 62);
    moe_routing_stats *s = stats_of(&t, 2000);
    moe_placement *p = plan(s, 4, 2, NULL, NULL), *q;
    char path[512];
    snprintf(path, sizeof path, "%s", tmp_path("plan.txt"));
    assert_int_equal(moe_placement_save(p, path, "planned by test_sched\npredicted: fewer rows"),
                     MOE_OK);
    char *text = read_text(path);
    printf("%s", text);
    assert_true(strncmp(text,
                        "moe-dist placement v1 experts 16 ranks 4\n# planned by test_sched\n"
                        "# predicted: fewer rows\nlayer 0: ",
                        strlen("moe-dist placement v1 experts 16 ranks 4\n# planned by "
                               "test_sched\n# predicted: fewer rows\nlayer 0: ")) == 0);
    free(text);
    assert_int_equal(moe_placement_load(&q, path, 2), MOE_OK);
    assert_true(moe_placement_equal(p, q));
    moe_placement_destroy(q);
    assert_int_equal(moe_placement_load(&q, path, 0), MOE_OK);
    assert_int_equal(q->ranks_per_node, 4);
    moe_placement_destroy(q);

    static const struct {
        const char *text;
        int rpn;
        int line;
        const char *needle;
    } bad[] = {
        {"", 0, 0, "empty file"},
        {"# only a comment\n", 0, 0, "empty file"},
        {"hello world\n", 0, 1, "not a plan file"},
        {"moe-dist placement v2 experts 8 ranks 4\n", 0, 1, "unsupported version 'v2"},
        {"moe-dist placement v1 experts 8\n", 0, 1, "expected 'ranks R'"},
        {"moe-dist placement v1 experts 8 ranks 3\nlayer 0: 0 0 0 1 1 1 2 2\n", 0, 1,
         "8 experts on 3 ranks"},
        {"moe-dist placement v1 experts 8 ranks 4 extra\n", 0, 1, "unexpected 'extra'"},
        {"moe-dist placement v1 experts 8 ranks 4\n", 0, 1, "no 'layer' lines"},
        {"moe-dist placement v1 experts 8 ranks 4\n\nlayer 0: 0 0 1 1 2 2 3\n", 0, 3,
         "layer 0 has 7 ranks, expected one per expert (8)"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 1 1 2 2 3 3 0\n", 0, 2,
         "layer 0 has more than 8 ranks"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 1 4 2 2 3 3\n", 0, 2,
         "layer 0: expert 3 on rank 4, not in [0, 4)"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 1 -1 2 2 3 3\n", 0, 2,
         "expert 3 on rank -1"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 0 1 1 2 3 3\n", 0, 2,
         "layer 0: rank 0 gets 3 experts, expected 2 (E / R)"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 1 1 2 2 3 3\n# x\nlayer 2: 0 0 1 1 "
         "2 2 3 3\n",
         0, 4, "layer 2 where layer 1 was expected"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 x 1 2 2 3 3\n", 0, 2,
         "the rank of expert 2 is not an integer: 'x 1 2 2 3 3'"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0 0 0 1 1 2 2 3 3\n", 0, 2,
         "expected 'layer 0: r0 r1 ...'"},
        {"moe-dist placement v1 experts 8 ranks 4\nlayer 0: 0 0 1 1 2 2 3 3\n", 3, 1,
         "3 ranks per node do not divide the plan's 4 ranks"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char name[32], where[600];
        snprintf(name, sizeof name, "bad%zu.plan", i);
        const char *bp = tmp_path(name);
        write_text(bp, bad[i].text);
        q = (moe_placement *)0x1;
        capture_begin();
        moe_status st = moe_placement_load(&q, bp, bad[i].rpn);
        const char *msg = capture_end();
        assert_int_equal(st, MOE_ERR_INVALID);
        assert_null(q);
        if (bad[i].line > 0)
            snprintf(where, sizeof where, "plan file %s:%d: ", bp, bad[i].line);
        else
            snprintf(where, sizeof where, "plan file %s: ", bp);
        assert_has(msg, where);
        assert_has(msg, bad[i].needle);
    }
    capture_begin();
    assert_int_equal(moe_placement_load(&q, tmp_path("missing.plan"), 0), MOE_ERR_IO);
    const char *msg = capture_end();
    assert_has(msg, "cannot open plan file");
    assert_has(msg, "missing.plan: No such file or directory");
    capture_begin();
    assert_int_equal(moe_placement_save(p, tmp_path("no/such/dir.plan"), NULL), MOE_ERR_IO);
    msg = capture_end();
    assert_has(msg, "cannot write plan file");
    moe_placement_destroy(p);
    moe_routing_stats_destroy(s);
    trace_free(&t);
}

/* ---- (g) the statistics file ---- */

/* Writes `text` with line `line` (1-based) replaced by `with` (NULL: removed) and every
 * line from `cut` on dropped (0: none). Returns the path. */
static const char *edit_lines(const char *src, const char *name, int line, const char *with,
                              int cut)
{
    char *text = read_text(src);
    const char *path = tmp_path(name);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    int n = 1;
    for (char *p = text, *nl; *p; p = nl + 1, n++) {
        nl = strchr(p, '\n');
        assert_non_null(nl);
        if (cut && n >= cut)
            break;
        if (n == line) {
            if (with)
                fprintf(f, "%s\n", with);
        } else {
            fwrite(p, 1, (size_t)(nl - p) + 1, f);
        }
    }
    fclose(f);
    free(text);
    return path;
}

static void test_stats_file(void **state)
{
    (void)state;
    /* layers 2, experts 3, top-2: token {0,1}, {1,2}, {0,1} in layer 0 */
    moe_routing_stats *s, *r;
    assert_int_equal(moe_routing_stats_create(&s, 2, 3), MOE_OK);
    const int32_t l0[] = {0, 1, 1, 2, 0, 1}, l1[] = {2, 0, 2, 1, 1, 0};
    assert_int_equal(moe_routing_stats_add(s, 0, l0, NULL, 3, 2), MOE_OK);
    assert_int_equal(moe_routing_stats_add(s, 1, l1, l0, 3, 2), MOE_OK);
    s->steps = 7;
    char path[512];
    snprintf(path, sizeof path, "%s", tmp_path("small.stats"));
    assert_int_equal(moe_routing_stats_save(s, path), MOE_OK);
    char *text = read_text(path);
    printf("%s", text);
    const char *expect = "moe-dist routing_stats v1 layers 2 experts 3 top_k 2 steps 7\n"
                         "tokens: 3 3\n"
                         "load 0: 2 3 1\n"
                         "coact 0 0: 0 2 0\n"
                         "coact 0 1: 2 0 1\n"
                         "coact 0 2: 0 1 0\n"
                         "trans 0 0: 2 1 1\n"
                         "trans 0 1: 2 2 2\n"
                         "trans 0 2: 0 1 1\n"
                         "load 1: 2 2 2\n"
                         "coact 1 0: 0 1 1\n"
                         "coact 1 1: 1 0 1\n"
                         "coact 1 2: 1 1 0\n"
                         "end\n";
    assert_string_equal(text, expect);
    free(text);
    assert_int_equal(moe_routing_stats_load(&r, path), MOE_OK);
    assert_int_equal(r->layers, 2);
    assert_int_equal(r->experts, 3);
    assert_int_equal(r->top_k, 2);
    assert_int_equal(r->steps, 7);
    assert_int_equal(r->count, s->count);
    assert_memory_equal(r->data, s->data, sizeof(int64_t) * s->count);
    moe_routing_stats_destroy(r);

    /* a bigger one round-trips too */
    trace t = trace_new(3, 2000, 4, 16, 4);
    for (int l = 0; l < 3; l++)
        gen_uniform(&t, l, NULL, 71 + l);
    moe_routing_stats *big = stats_of(&t, 2000);
    assert_int_equal(moe_routing_stats_save(big, tmp_path("big.stats")), MOE_OK);
    assert_int_equal(moe_routing_stats_load(&r, tmp_path("big.stats")), MOE_OK);
    assert_memory_equal(r->data, big->data, sizeof(int64_t) * big->count);
    moe_routing_stats_destroy(r);
    moe_routing_stats_destroy(big);
    trace_free(&t);

    static const struct {
        int line;
        const char *with; /* NULL: line removed */
        int cut;          /* drop lines from here */
        int err_line;     /* 0: no line in the message */
        const char *needle;
    } bad[] = {
        {0, NULL, 1, 0, "empty file"},
        {1, "moe-dist routing_stats v2 layers 2 experts 3 top_k 2 steps 7", 0, 1,
         "unsupported version 'v2"},
        {1, "moe-dist placement v1 experts 3 ranks 1", 0, 1, "not a routing_stats file"},
        {1, "moe-dist routing_stats v1 layers 2 experts 3 top_k 2", 0, 1,
         "header: expected 'steps' and a number"},
        {1, "moe-dist routing_stats v1 layers 0 experts 3 top_k 2 steps 7", 0, 1,
         "0 layers and 3 experts"},
        {2, "tokens: 3", 0, 2, "'tokens:' has 1 counts, expected 2"},
        {3, "load 0: 2 3 1 4", 0, 3, "'load 0:' has more than 3 counts: '4'"},
        {3, "load 0: 2 -3 1", 0, 3, "count 1 of 'load 0:' is negative (-3)"},
        {3, "load 0: 2 3 x", 0, 3, "count 2 of 'load 0:' is not an integer: 'x'"},
        {3, "load 0: 2 3 9", 0, 3, "layer 0: 14 assignments for 3 tokens at top-2"},
        {4, "coact 0 0: 1 2 0", 0, 4, "diagonal (0,0) is 1"},
        {5, "coact 0 1: 1 0 1", 0, 5, "coact 0 is not symmetric: (1,0) = 1 but (0,1) = 2"},
        {5, "coact 0 2: 0 1 0", 0, 5, "expected 'coact 0 1:', found 'coact 0 2: 0 1 0'"},
        {5, NULL, 0, 5, "expected 'coact 0 1:'"},
        {6, "coact 0 2: 0 2 0", 0, 6, "coact 0 is not symmetric: (2,1) = 2 but (1,2) = 1"},
        {7, "trans 0 0: 2 1 9", 0, 7, "trans 0 0: row sum 12 exceeds top_k * load = 4"},
        {0, NULL, 12, 11, "the file ends here, expected 'coact 1 1:' (truncated?)"},
        {0, NULL, 14, 13, "the file ends here, expected 'end'"},
        {14, "end\nmore", 0, 15, "unexpected text after 'end': 'more'"},
        {14, "fin", 0, 14, "expected 'end', found 'fin'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char name[32], where[600];
        snprintf(name, sizeof name, "bad%zu.stats", i);
        const char *bp = edit_lines(path, name, bad[i].line, bad[i].with, bad[i].cut);
        r = (moe_routing_stats *)0x1;
        capture_begin();
        moe_status st = moe_routing_stats_load(&r, bp);
        const char *msg = capture_end();
        assert_int_equal(st, MOE_ERR_INVALID);
        assert_null(r);
        if (bad[i].err_line > 0)
            snprintf(where, sizeof where, "routing_stats file %s:%d: ", bp, bad[i].err_line);
        else
            snprintf(where, sizeof where, "routing_stats file %s: ", bp);
        assert_has(msg, where);
        assert_has(msg, bad[i].needle);
    }
    capture_begin();
    assert_int_equal(moe_routing_stats_load(&r, tmp_path("missing.stats")), MOE_ERR_IO);
    const char *msg = capture_end();
    assert_has(msg, "cannot open routing_stats file");
    moe_routing_stats_destroy(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stats_counts),        cmocka_unit_test(test_stats_merge),
        cmocka_unit_test(test_stats_print),         cmocka_unit_test(test_planted_groups_top2),
        cmocka_unit_test(test_planted_groups_top4), cmocka_unit_test(test_planted_groups_large),
        cmocka_unit_test(test_node_level),          cmocka_unit_test(test_chains),
        cmocka_unit_test(test_uniform_never_worse), cmocka_unit_test(test_skewed_balance),
        cmocka_unit_test(test_infeasible_bound),    cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_cost_by_hand),        cmocka_unit_test(test_plan_file),
        cmocka_unit_test(test_stats_file),
    };
    return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
